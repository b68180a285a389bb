"""Tiny random-weight Qwen-VL and Kimi K2.5 checkpoints, built locally in seconds (nothing is downloaded).

Kimi K2.5's parts are in ``tiny_kimi``; what follows describes the Qwen-VL ones.

A checkpoint directory holds what ``from_pretrained`` (and vLLM) expect of a real Qwen2-VL / Qwen3-VL
release: a standard ``config.json`` with the vision config and special-token ids, safetensors weights,
a byte-level BPE tokenizer trained here on a small built-in corpus with Qwen's special tokens and a
Qwen-style chat template, a generation config and a processor (image processor + tokenizer).

The image processor keeps the preset's values except ``max_pixels``, which defaults to at most
``TINY_MAX_TOKENS`` placeholder tokens per image so that demos and CPU tests stay fast; pass
``max_pixels`` to change it. Everything is deterministic per seed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rawmm.contract.families import QwenVLConfig, resolve_preset

TINY_PRESETS: tuple[str, ...] = ("qwen2_vl", "qwen3_vl", "kimi_k25")
TINY_MAX_TOKENS = 256  # default max_pixels = TINY_MAX_TOKENS * (patch * merge)^2
TOKENIZER_VOCAB = 640  # learned byte-level BPE vocabulary, before the special tokens

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen's chat format: one <|vision_start|><|image_pad|><|vision_end|> per image part, in order.
# Any part that is not text (image_url / image with any source key) counts as an image.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Same split as Qwen2's tokenizer: contractions, letters, single digits, punctuation runs, whitespace.
_PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _corpus() -> Iterator[str]:
    """Deterministic training text: chat, shapes and colours, digits, some code-ish punctuation."""
    colours = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "gray", "pink")
    shapes = ("square", "circle", "triangle", "rectangle", "star", "line", "dot", "cross")
    sizes = ("small", "large", "tiny", "big", "medium")
    yield "You are a helpful assistant. Describe the image. What do you see in the picture?"
    yield "The answer is: yes. No, that is not right. Count the objects and tell me how many there are."
    yield "Think step by step, then answer with a single word or number."
    for i, colour in enumerate(colours):
        for j, shape in enumerate(shapes):
            size = sizes[(i + j) % len(sizes)]
            yield f"There is a {size} {colour} {shape} at ({i * 10 + j}, {j * 7 + i}) in the image."
            yield f"Q: Which shape is {colour}? A: the {shape}. Score: {i + j}/{len(shapes)}."
    yield "def f(x): return [x + 1, x * 2] # {'key': \"value\"} <= >= != == -> ... ;:"
    yield " ".join(str(n) for n in range(100))


def build_tokenizer(
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    *,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """A Qwen2Tokenizer (byte-level BPE) with Qwen's special tokens and chat template, or another family's."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        # transformers annotates these as list[str] and str; it takes merge pairs and no unk token
        merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]
        eos_token=eos_token,
        pad_token=pad_token,
        extra_special_tokens=[t for t in special_tokens if t not in (eos_token, pad_token)],
        model_max_length=32768,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """The sizes of a tiny model. Attention head sizes are ones real kernels take: vLLM's CPU attention
    needs a head_dim of 32, 64, 80, 96, 112, 128, ...; GPU kernels are tuned for 128."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vision_hidden_size: int
    vision_heads: int
    # M-RoPE split of head_dim / 2 rotary frequencies over (t, h, w); Qwen2-VL's contiguous, Qwen3-VL's interleaved
    qwen2_mrope_section: tuple[int, int, int]
    qwen3_mrope_section: tuple[int, int, int]


CPU_SHAPE = TinyShape(64, 2, 1, 32, 32, 2, (4, 6, 6), (8, 4, 4))
GPU_SHAPE = TinyShape(256, 2, 1, 128, 128, 2, (16, 24, 24), (24, 20, 20))


def _model_config(preset: str, tokenizer: Any, image: QwenVLConfig, shape: TinyShape) -> Any:
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    text: dict[str, Any] = {
        "vocab_size": _round_up(len(tokenizer), 64),
        "hidden_size": shape.hidden_size,
        "intermediate_size": 2 * shape.hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": eos[1],
        "tie_word_embeddings": False,
    }
    if preset == "qwen2_vl":
        from transformers import Qwen2VLConfig

        if shape.hidden_size != shape.num_attention_heads * shape.head_dim:
            raise ValueError("Qwen2-VL derives head_dim from hidden_size / num_attention_heads")
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": list(shape.qwen2_mrope_section),
        }
        vision: dict[str, Any] = {
            "depth": 2,
            "embed_dim": shape.vision_hidden_size,
            "hidden_size": shape.hidden_size,
            "num_heads": shape.vision_heads,
            "mlp_ratio": 2,
            "patch_size": image.patch_size,
            "spatial_merge_size": image.merge_size,
            "temporal_patch_size": image.temporal_patch_size,
        }
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    from transformers import Qwen3VLConfig

    text["head_dim"] = shape.head_dim
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": list(shape.qwen3_mrope_section),
        "mrope_interleaved": True,
    }
    vision = {
        "depth": 2,
        "hidden_size": shape.vision_hidden_size,
        "intermediate_size": 2 * shape.vision_hidden_size,
        "num_heads": shape.vision_heads,
        "out_hidden_size": shape.hidden_size,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [1],
        "patch_size": image.patch_size,
        "spatial_merge_size": image.merge_size,
        "temporal_patch_size": image.temporal_patch_size,
    }
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def build_tiny_model(
    preset: str, out: Path, seed: int = 0, *, max_pixels: int | None = None, gpu_shape: bool = False
) -> Path:
    """Write a tiny random-weight ``preset`` checkpoint (model, tokenizer, processor) to ``out``.

    ``max_pixels`` defaults to ``TINY_MAX_TOKENS`` placeholder tokens' worth of pixels; ``gpu_shape`` gives
    attention heads of 128 (GPU attention kernels) instead of the CPU shape's 32. The directory is
    written next to ``out`` and renamed into place, so ``out`` is either absent or complete.
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"tiny models exist for presets {TINY_PRESETS}, not {preset!r}")
    if preset == "kimi_k25":
        return _build_tiny_kimi(out, seed, max_pixels=max_pixels, gpu_shape=gpu_shape)
    from transformers import (
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from rawmm.materialize import qwen_image_processor

    _, image = resolve_preset(preset)
    if max_pixels is None:
        max_pixels = TINY_MAX_TOKENS * image.factor**2
    if max_pixels < image.min_pixels:
        raise ValueError(f"max_pixels {max_pixels} is below the preset's min_pixels {image.min_pixels}")

    tokenizer = build_tokenizer()
    config = _model_config(preset, tokenizer, image, GPU_SHAPE if gpu_shape else CPU_SHAPE)
    model_class = Qwen2VLForConditionalGeneration if preset == "qwen2_vl" else Qwen3VLForConditionalGeneration
    processor_class = Qwen2VLProcessor if preset == "qwen2_vl" else Qwen3VLProcessor
    image_processor = qwen_image_processor(dataclasses.replace(image, max_pixels=max_pixels), backend="pil")
    # Processors need a video processor to load; rawmm sends no video, so it just mirrors the patch layout.
    video_class = Qwen2VLVideoProcessor if preset == "qwen2_vl" else Qwen3VLVideoProcessor
    video_processor = video_class(
        patch_size=image.patch_size,
        merge_size=image.merge_size,
        temporal_patch_size=image.temporal_patch_size,
        image_mean=list(image.image_mean),
        image_std=list(image.image_std),
    )
    model, processor, generation = assemble_parts(
        model_class, config, seed, processor_class, image_processor, video_processor, tokenizer, CHAT_TEMPLATE
    )
    return _write(out, model, generation, processor)


def assemble_parts(
    model_class: Any,
    config: Any,
    seed: int,
    processor_class: Any,
    image_processor: Any,
    video_processor: Any,
    tokenizer: Any,
    chat_template: str,
) -> tuple[Any, Any, Any]:
    """A tiny checkpoint's random-weight model (seeded by ``seed``, the global RNG left as it was), its
    processor and its generation config (the text config's end and pad tokens), for every family."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float().eval()
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )
    text = config.text_config
    generation = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    return model, processor, generation


def _build_tiny_kimi(out: Path, seed: int, *, max_pixels: int | None, gpu_shape: bool) -> Path:
    """Kimi K2.5 (``tiny_kimi``): ``max_pixels`` bounds the patches per image (pixels / patch²)."""
    from rawmm.materialize import get_adapter
    from rawmm.run import tiny_kimi

    _, image = resolve_preset("kimi_k25")
    max_tokens = TINY_MAX_TOKENS
    if max_pixels is not None:
        max_tokens = max_pixels // (image.patch_size * image.merge_size) ** 2
        if max_tokens < 1:
            raise ValueError(
                f"max_pixels {max_pixels} is below one vision token ({image.patch_size * image.merge_size}² px)"
            )
    tokenizer = build_tokenizer(
        tiny_kimi.SPECIAL_TOKENS,
        eos_token=tiny_kimi.EOS_TOKEN,
        pad_token=tiny_kimi.PAD_TOKEN,
        chat_template=tiny_kimi.CHAT_TEMPLATE,
    )
    model, processor, generation = tiny_kimi.build_parts(
        tokenizer, max_tokens, gpu_shape=gpu_shape, seed=seed
    )
    # transformers 5 nests the image processor in processor_config.json; rawmm and vLLM read a Kimi
    # checkpoint's media_proc_cfg from preprocessor_config.json, where the published one has it.
    finish = get_adapter("kimi_k25").publish_checkpoint  # the published format, which vLLM loads
    return _write(out, model, generation, processor, processor.image_processor, finish=finish)


def _write(out: Path, model: Any, *parts: Any, finish: Callable[[Path], None] | None = None) -> Path:
    """Save the model and ``parts`` next to ``out`` (then ``finish`` the directory) and rename them into
    place: ``out`` is either absent or complete."""
    from transformers.utils import logging as hf_logging

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    progress_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for one 1 MB file is noise
    try:
        model.save_pretrained(staging)
        for part in parts:
            part.save_pretrained(staging)
        if finish is not None:
            finish(staging)
        if out.exists():
            shutil.rmtree(out)
        for path in (staging, *staging.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)  # readable by engine/trainer pods of other users
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if progress_was_on:
            hf_logging.enable_progress_bar()
    return out
