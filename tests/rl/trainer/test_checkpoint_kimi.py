"""A trainer checkpoint of Kimi K2.5 is in the format the engines serve: the served checkpoint's tensor names,
dtypes and shapes (what an engine's reload checks before it loads: vLLM refuses any other name), the
published config fields, and the trained weights when transformers loads it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from rawmm.rl.trainer.checkpoint import save_checkpoint
from rawmm.run.tiny import build_tiny_model


def tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return {name: (str(handle.get_slice(name).get_dtype()), tuple(handle.get_slice(name).get_shape()))
                for name in handle.keys()}  # fmt: skip  # noqa: SIM118 (a safe_open handle is not a mapping)


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("kimi_k25", tmp_path_factory.mktemp("tiny") / "kimi_k25", seed=0)


def test_a_kimi_checkpoint_fits_the_served_one_and_loads_back(tiny_kimi: Path, tmp_path: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_kimi, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (sum(p.sum() for p in model.parameters())).backward()
    optimizer.step()
    saved = save_checkpoint(model, optimizer, tiny_kimi, tmp_path / "checkpoints", 1, is_main=True)

    assert tensors(saved) == tensors(tiny_kimi)  # vLLM's reload: same names, dtypes, shapes as served
    config = json.loads((saved / "config.json").read_text())
    assert (
        config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["use_unified_vision_chunk"]
    )
    again = AutoModelForImageTextToText.from_pretrained(saved, dtype=torch.float32).state_dict()
    trained = model.state_dict()
    assert again.keys() == trained.keys() and all(torch.equal(again[k], trained[k]) for k in trained)
