from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rawmm.contract import get_family
from rawmm.run.tiny import TINY_MAX_TOKENS, build_tiny_model

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|endoftext|>",
]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(params=["tiny_qwen2_vl", "tiny_qwen3_vl"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_checkpoint_is_small_standard_and_loads_offline(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, GenerationConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sum(p.stat().st_size for p in checkpoint.iterdir()) < 5_000_000
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = dict(zip(SPECIAL, tokenizer.convert_tokens_to_ids(SPECIAL), strict=True))
    assert len(set(ids.values())) == len(SPECIAL)
    assert all(tokenizer.convert_ids_to_tokens(i) == token for token, i in ids.items())
    assert config["architectures"] == [
        {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}[
            config["model_type"]
        ]
    ]
    assert (config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]) == (
        ids["<|image_pad|>"],
        ids["<|vision_start|>"],
        ids["<|vision_end|>"],
    )
    assert config["text_config"]["vocab_size"] >= len(tokenizer)
    assert (
        config["vision_config"]["patch_size"] == get_family("qwen_vl").preset(config["model_type"]).patch_size
    )

    model = AutoModelForImageTextToText.from_pretrained(checkpoint)
    assert type(model).__name__ == config["architectures"][0]
    processor = AutoProcessor.from_pretrained(checkpoint)
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == ids["<|image_pad|>"]
    generation = GenerationConfig.from_pretrained(checkpoint)
    assert ids["<|im_end|>"] in generation.eos_token_id


def test_tokenizer_round_trips_text_and_renders_qwen_chat(tiny_qwen2_vl: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    text = "A red square at (12, 7) — naïve café 🙂\n\tdone."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "file:///x"}},
            ],
        },
        {"role": "assistant", "content": "ok"},
    ]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\nhi<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>assistant\n"
    )


def test_default_max_pixels_keeps_images_small(checkpoint: Path) -> None:
    qwen = get_family("qwen_vl")
    config = qwen.config_from_pretrained(checkpoint)
    assert config.max_pixels == TINY_MAX_TOKENS * config.factor**2
    assert qwen.describe(width=4000, height=3000, config=config).num_placeholder_tokens <= TINY_MAX_TOKENS


def test_deterministic_per_seed_and_configurable(tmp_path: Path, tiny_qwen3_vl: Path) -> None:
    from safetensors.torch import load_file

    again = build_tiny_model("qwen3_vl", tmp_path / "again", seed=0)
    assert digests(again) == digests(tiny_qwen3_vl)
    other = build_tiny_model("qwen3_vl", tmp_path / "other", seed=1, max_pixels=70_000)
    weights, other_weights = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == other_weights.keys()
    assert any(not torch.equal(weights[k], other_weights[k]) for k in weights)
    assert get_family("qwen_vl").config_from_pretrained(other).max_pixels == 70_000
    rebuilt = build_tiny_model("qwen3_vl", tmp_path / "other", seed=0)  # replaces an existing directory
    assert digests(rebuilt) == digests(tiny_qwen3_vl)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]  # no staging leftovers


def test_bad_requests(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny models exist"):
        build_tiny_model("qwen2_5_vl", tmp_path / "k")
    with pytest.raises(ValueError, match="below the preset's min_pixels"):
        build_tiny_model("qwen3_vl", tmp_path / "q", max_pixels=100)
    assert not any(tmp_path.iterdir())
