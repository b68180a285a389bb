"""Kimi K2.5 checkpoints in the published format: what vLLM's Kimi-K2.5 loads.

transformers 5.19 saves a Kimi K2.5 (``save_pretrained``) in the hub's format but for three weight names,
which vLLM's loader and the published checkpoints spell otherwise: its reverse ``blocks`` rule also renames
the text layers, and two vision/projector names keep transformers' own prefix. Its config also names
transformers' class, not the published ``KimiK25ForConditionalGeneration`` vLLM registers. ``publish``
rewrites a saved checkpoint in place; transformers loads the result back bit for bit. The tiny checkpoint
and every trainer checkpoint pass through it, so an engine can reload what the trainer wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

_HUB_NAMES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.", "mm_projector."),
)
ARCHITECTURE = "KimiK25ForConditionalGeneration"  # the published config's name, which vLLM registers


def hub_weight_name(name: str) -> str:
    """A weight's name in the published checkpoint, from the one transformers 5.19 saved it under."""
    for saved, published in _HUB_NAMES:
        if name.startswith(saved):
            return published + name[len(saved) :]
    return name


def publish(checkpoint: Path) -> None:
    """Rewrite a saved Kimi checkpoint in place with the published weight names and config fields, which
    transformers loads back bit for bit and vLLM's Kimi-K2.5 loads at all."""
    from safetensors.torch import load_file, save_file

    for file in sorted(checkpoint.glob("*.safetensors")):
        weights = load_file(file)
        save_file({hub_weight_name(k): v for k, v in weights.items()}, file, metadata={"format": "pt"})
    index_file = checkpoint / "model.safetensors.index.json"  # a sharded checkpoint's name -> file map
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {hub_weight_name(k): v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [ARCHITECTURE]
    # The published config's flag by which vLLM files a chat request's images under vision_chunk (the one
    # modality its Kimi-K2.5 takes); without it vLLM's own chat path refuses every image.
    config["use_unified_vision_chunk"] = True
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
