"""`rawmm tiny-model --preset kimi_k25`: a Kimi K2.5 checkpoint every consumer loads as a real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from rawmm.contract import detect_family
from rawmm.materialize import load_processor
from rawmm.run.tiny import TINY_MAX_TOKENS, build_tiny_model


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("kimi_k25", tmp_path_factory.mktemp("tiny") / "kimi_k25", seed=0)


def test_the_checkpoint_is_a_kimi_k25_that_transformers_and_rawmm_load(tiny_kimi: Path) -> None:
    assert detect_family(tiny_kimi).name == "kimi_k25"
    model = AutoModelForImageTextToText.from_pretrained(tiny_kimi, dtype=torch.float32)
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    text = model.config.text_config
    assert text.model_type == "deepseek_v3" and text.n_routed_experts == 4 and text.first_k_dense_replace == 1
    assert (text.kv_lora_rank, text.qk_rope_head_dim) == (512, 64)  # vLLM-CPU's one MLA head size: 576
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    tokenizer = AutoTokenizer.from_pretrained(tiny_kimi)
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|media_pad|>")
    # The published media_proc_cfg (rawmm, vLLM) beside transformers' own processor keys.
    media = json.loads((tiny_kimi / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert media["in_patch_limit"] == TINY_MAX_TOKENS * 4 and media["temporal_merge_kernel_size"] == 4
    assert type(AutoProcessor.from_pretrained(tiny_kimi)).__name__ == "Kimi_K25Processor"
    for backend in ("pil", "torchvision"):
        assert load_processor(tiny_kimi, backend).config.in_patch_limit == TINY_MAX_TOKENS * 4


def test_the_checkpoint_is_in_the_published_format_vllm_loads(tiny_kimi: Path) -> None:
    """vLLM registers KimiK25ForConditionalGeneration (transformers' class is Kimi_K25...: vLLM would fall back
    to its generic Transformers backend), files chat images under vision_chunk only with the published
    flag, and loads the published weight names."""
    from safetensors import safe_open

    config = json.loads((tiny_kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["use_unified_vision_chunk"] is True
    assert config["text_config"]["topk_method"] == "noaux_tc"  # vLLM builds the gate's correction bias
    with safe_open(str(tiny_kimi / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "language_model.model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert {"vision_tower.patch_embed.proj.weight", "mm_projector.pre_norm.weight"} <= names
    assert not any(".blocks." in n for n in names if n.startswith("language_model."))
    assert not any(n.startswith("model.") for n in names)


def test_saved_weights_load_back_bit_for_bit(tiny_kimi: Path, tmp_path: Path) -> None:
    """The trainer saves checkpoints with save_pretrained (the hub's format), the engines load them back."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_kimi, dtype=torch.float32)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForImageTextToText.from_pretrained(tmp_path / "again", dtype=torch.float32)
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_chat_template_writes_one_media_pad_per_image(tiny_kimi: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_kimi)
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "image"}]}
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.count("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>") == 2
    assert text.startswith("<|im_user|>user<|im_middle|>") and text.endswith(
        "<|im_assistant|>assistant<|im_middle|>"
    )
