"""A tiny random-weight Kimi K2.5 checkpoint (transformers 5.19's ``Kimi_K25ForConditionalGeneration``).

The text stack is DeepSeek-V3 (MLA attention, one dense layer then one MoE layer with 4 routed experts, 2
per token, and a shared expert), the vision tower a 2-block MoonViT, both as small as the architecture
allows. Fixed by the architecture or the kernels, not by taste:
- ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: vLLM-CPU's MLA decode kernel compiles for a latent
  head of 576 = 512 + 64 only (``CPUMLABackend.get_supported_head_sizes``); GPU MLA kernels take it too;
- a ``q_lora_rank`` (the published model's low-rank query): transformers 5.19 saves a Kimi checkpoint
  in the hub's format, and its reverse rule for the vision tower's fused ``wqkv`` also catches a text
  ``self_attn.q_proj``, so a full-rank query would be saved as ``self_wqkv`` and not load back.

The checkpoint's ``preprocessor_config.json`` holds the published ``media_proc_cfg`` (what rawmm and vLLM
read) beside transformers' ``Kimi_K25ImageProcessor`` keys, at tiny patch limits: at most
``TINY_MAX_TOKENS`` vision tokens per image. The tokenizer is the tiny byte-level BPE with Kimi's special
tokens and a Kimi-style chat template (one ``<|media_pad|>`` per image part).
"""

from __future__ import annotations

from typing import Any

from rawmm.contract.families import KimiK25Config
from rawmm.run.tiny import assemble_parts

SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "[PAD]"

# Kimi's chat format: <|im_ROLE|>ROLE<|im_middle|>CONTENT<|im_end|>, an image part as the published
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|> (vLLM's placeholder string too).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)


def image_config(max_tokens: int) -> KimiK25Config:
    """The preset's processing with the patch budget of ``max_tokens`` vision tokens per image."""
    preset = KimiK25Config()
    return KimiK25Config(
        patch_size=preset.patch_size,
        merge_size=preset.merge_size,
        in_patch_limit=max_tokens * preset.merge_size**2,
        patch_limit_on_one_side=preset.patch_limit_on_one_side,
        image_mean=preset.image_mean,
        image_std=preset.image_std,
    )


def media_proc_cfg(config: KimiK25Config) -> dict[str, Any]:
    """The published ``media_proc_cfg`` (every key vLLM's Kimi processor reads), at ``config``'s values."""
    return {
        "in_patch_limit": config.in_patch_limit,
        "patch_size": config.patch_size,
        "image_mean": list(config.image_mean),
        "image_std": list(config.image_std),
        "merge_kernel_size": config.merge_size,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": config.patch_limit_on_one_side,
        "in_patch_limit_each_frame": config.in_patch_limit,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
    }


def model_config(tokenizer: Any, image: KimiK25Config, *, gpu_shape: bool) -> Any:
    from transformers import Kimi_K25Config

    def token(name: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(name))

    vocab = -(-len(tokenizer) // 64) * 64
    eos = [token(EOS_TOKEN), token("[EOS]")]
    text = {
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": 256 if gpu_shape else 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_mtp_layers": 0,
        # What transformers' DeepSeek-V3 always does (sigmoid scores, a corrected top-k); the published configs
        # say so, and vLLM's DeepseekV2 builds the gate's correction bias only when told.
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0},
        "tie_word_embeddings": False,
        "bos_token_id": token("[BOS]"),
        "eos_token_id": eos,
        "pad_token_id": token(PAD_TOKEN),
    }
    vision_hidden = 128 if gpu_shape else 64
    vision = {
        "patch_size": image.patch_size,
        "merge_kernel_size": [image.merge_size, image.merge_size],
        "pos_emb_height": 16,
        "pos_emb_width": 16,
        "pos_emb_time": 4,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "hidden_size": vision_hidden,
        "intermediate_size": 2 * vision_hidden,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10_000.0},
    }
    return Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=vision_hidden,
        image_token_id=token("<|media_pad|>"),
        video_token_id=token("<|kimi_k25_video_placeholder|>"),
        vision_start_token_id=token("<|media_begin|>"),
        vision_end_token_id=token("<|media_end|>"),
        tie_word_embeddings=False,
    )


def build_parts(tokenizer: Any, max_tokens: int, *, gpu_shape: bool, seed: int) -> tuple[Any, Any, Any]:
    """The model, the processor (tokenizer + transformers' image processor) and the generation config."""
    from transformers import (
        Kimi_K25ForConditionalGeneration,
        Kimi_K25ImageProcessor,
        Kimi_K25Processor,
        Kimi_K25VideoProcessor,
    )

    image = image_config(max_tokens)
    side = image.patch_limit_on_one_side
    layout = {
        "size": {"max_height": side, "max_width": side},
        "max_patches": image.in_patch_limit,
        "patch_size": image.patch_size,
        "merge_size": image.merge_size,
        "image_mean": list(image.image_mean),
        "image_std": list(image.image_std),
    }
    image_processor = Kimi_K25ImageProcessor(**layout)
    # rawmm and vLLM read the published media_proc_cfg; it is saved with the image processor's keys.
    setattr(image_processor, "media_proc_cfg", media_proc_cfg(image))  # noqa: B010 (no such attribute in its type)
    # Processors need a video processor to load; rawmm sends no video, so it just mirrors the patch layout.
    video_processor = Kimi_K25VideoProcessor(**layout)
    config = model_config(tokenizer, image, gpu_shape=gpu_shape)
    return assemble_parts(
        Kimi_K25ForConditionalGeneration,
        config,
        seed,
        Kimi_K25Processor,
        image_processor,
        video_processor,
        tokenizer,
        CHAT_TEMPLATE,
    )
