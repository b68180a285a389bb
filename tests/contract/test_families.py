import dataclasses
import json
from pathlib import Path
from typing import Any, Literal, get_args

import pytest

from rawmm.contract import (
    InvalidImageRef,
    KimiK25Config,
    QwenVLConfig,
    detect_family,
    get_family,
    resolve_preset,
)
from rawmm.contract.families import FAMILIES, MODEL_TYPES, PRESETS, Preset
from rawmm.contract.families.base import Family

qwen = get_family("qwen_vl")
kimi = get_family("kimi_k25")


def test_registry() -> None:
    assert set(FAMILIES) == {"qwen_vl", "kimi_k25"}
    assert PRESETS == {
        "qwen2_vl": "qwen_vl",
        "qwen2_5_vl": "qwen_vl",
        "qwen3_vl": "qwen_vl",
        "kimi_k25": "kimi_k25",
    }
    with pytest.raises(InvalidImageRef) as info:
        get_family("llava")
    assert info.value.reason == "unknown_family"
    assert (qwen.engine_modality, kimi.engine_modality) == ("image", "vision_chunk")
    with pytest.raises(ValueError, match="no preset"):
        qwen.preset("kimi_k25")
    with pytest.raises(ValueError, match="unknown model preset"):
        resolve_preset("gpt")


# The published preprocessor configs, in the two key styles the Qwen releases use.
QWEN2_VL_PUBLIC = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
QWEN3_VL_PUBLIC = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
KIMI_K25_PUBLIC = {
    "media_proc_cfg": {
        "in_patch_limit": 16384,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
    }
}


def write_checkpoint(root: Path, preprocessor: dict, model_type: str) -> Path:
    root.mkdir()
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


@pytest.mark.parametrize(
    ("preset", "public", "model_type"),
    [
        ("qwen2_vl", QWEN2_VL_PUBLIC, "qwen2_vl"),
        ("qwen2_5_vl", QWEN2_VL_PUBLIC, "qwen2_5_vl"),
        ("qwen3_vl", QWEN3_VL_PUBLIC, "qwen3_vl"),
        ("kimi_k25", KIMI_K25_PUBLIC, "kimi_k25"),
    ],
)
def test_presets_equal_the_published_preprocessor_configs(
    tmp_path: Path, preset: str, public: dict, model_type: str
) -> None:
    checkpoint = write_checkpoint(tmp_path / preset, public, model_type)
    family, config = resolve_preset(preset)
    assert detect_family(checkpoint) is family
    loaded = family.config_from_pretrained(checkpoint)
    assert loaded == config
    assert family.fingerprint(loaded, "pil") == family.fingerprint(config, "pil")


def test_checkpoint_family_detection_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        detect_family(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        detect_family(write_checkpoint(tmp_path / "llava", {}, "llava"))


def test_a_kimi_processor_config_identifies_a_checkpoint_of_another_model_type(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "kimi", KIMI_K25_PUBLIC, "kimi_k25_remote_code")
    assert detect_family(checkpoint) is kimi


def test_everything_about_families_derives_from_their_records() -> None:
    from rawmm.config import ModelConfig

    assert set(get_args(Preset)) == set(PRESETS)
    assert ModelConfig.model_json_schema()["properties"]["preset"]["enum"] == list(get_args(Preset))
    assert MODEL_TYPES == {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl",
                           "qwen3_vl_moe": "qwen_vl", "kimi_k25": "kimi_k25"}  # fmt: skip


def test_a_family_whose_preset_type_and_presets_differ_is_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="preset_names"):

        class Broken(Family[Any]):  # the class statement itself fails
            preset_names = Literal["a", "b"]
            presets = {"a": None}


@pytest.mark.parametrize("family_name", ["qwen_vl", "kimi_k25"])
def test_fingerprint_covers_every_config_value_and_the_backend(family_name: str) -> None:
    family = get_family(family_name)
    config = next(iter(family.presets.values()))
    base = family.fingerprint(config, "pil")
    assert len(base) == 16 and int(base, 16) >= 0
    assert family.fingerprint(config, "torchvision") != base
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            changed = not value
        elif isinstance(value, tuple):
            changed = tuple(v + 0.01 for v in value)
        else:
            changed = value * 2 if value else 1
        assert family.fingerprint(dataclasses.replace(config, **{field.name: changed}), "pil") != base, (
            field.name
        )
    with pytest.raises(ValueError, match="backend"):
        family.fingerprint(config, "opencv")


def test_fingerprint_is_stable_across_families_and_types() -> None:
    assert qwen.fingerprint(qwen.preset("qwen2_vl"), "pil") == qwen.fingerprint(
        qwen.preset("qwen2_5_vl"), "pil"
    )
    assert qwen.fingerprint(qwen.preset("qwen2_vl"), "pil") != qwen.fingerprint(
        qwen.preset("qwen3_vl"), "pil"
    )
    with pytest.raises(TypeError):
        qwen.fingerprint(KimiK25Config(), "pil")


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_config_from_processor_matches_config_from_pretrained(tiny_qwen2_vl: Path, backend: str) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_qwen2_vl, backend=backend)
    from_processor = qwen.config_from_processor(processor)
    assert from_processor == qwen.config_from_pretrained(tiny_qwen2_vl)
    assert qwen.fingerprint(from_processor, backend) == qwen.fingerprint(
        qwen.config_from_pretrained(tiny_qwen2_vl), backend
    )


def test_payload_round_trip_and_strictness() -> None:
    for family, config in ((qwen, qwen.preset("qwen3_vl")), (kimi, kimi.preset("kimi_k25"))):
        layout = family.describe(width=640, height=480, config=config)
        assert family.grid_from_payload(json.loads(json.dumps(family.payload(layout)))) == layout.grid_thw
        for bad in (
            {},
            {"image_grid_thw": [[1, 2]]},
            {"grid_thws": [[1, 2, 0]]},
            {"image_grid_thw": [[1, 2, True]]},
            {"grid_thws": [[1, 2, 2], [1, 2, 2]]},
            [[1, 2, 2]],
            {"image_grid_thw": "1,2,2"},
        ):
            with pytest.raises(InvalidImageRef) as info:
                family.grid_from_payload(bad)
            assert info.value.reason == "malformed_ref"


@pytest.mark.parametrize("size", [(0, 10), (10, -1), (1.5, 10), (True, 10)])
def test_describe_rejects_impossible_sizes(size: tuple) -> None:
    for family, config in ((qwen, qwen.preset("qwen2_vl")), (kimi, kimi.preset("kimi_k25"))):
        with pytest.raises(ValueError, match="positive integer"):
            family.describe(width=size[0], height=size[1], config=config)


def test_qwen_rejects_aspect_ratios_beyond_200() -> None:
    config = qwen.preset("qwen2_vl")
    assert qwen.describe(width=200, height=1, config=config).grid_thw[0] == 1
    with pytest.raises(ValueError, match="aspect ratio"):
        qwen.describe(width=201, height=1, config=config)


# --- Kimi K2.5: hand-worked cases of the published navit math --------------------------------------
# f = merge * patch = 28, side limit L = 512 * 14 = 7168.
KIMI_CASES = [
    # (w, h) -> (resized h, w), grid, vision tokens
    ((1, 1), (1, 1), (1, 2, 2), 1),  # floor(1/14)=0 -> clamped to 1 patch; pad up to one 28x28 block
    ((100, 50), (50, 100), (1, 4, 8), 8),  # no scaling; pad 100->112, 50->56
    ((1920, 1080), (1080, 1920), (1, 78, 138), 2691),  # 137*77 patches < 16384; pad to 1932x1092
    ((4000, 4000), (1796, 1796), (1, 130, 130), 4225),  # scale = sqrt(16384/285^2) = 128/285; 1796 -> 1820
    ((14336, 28), (14, 7168), (1, 2, 512), 256),  # side limit: scale = 7168/14336 = 0.5 exactly
    ((28, 28), (28, 28), (1, 2, 2), 1),  # already a multiple of 28
]


@pytest.mark.parametrize(("size", "resized", "grid", "vision_tokens"), KIMI_CASES)
def test_kimi_hand_checked_layouts(size: tuple, resized: tuple, grid: tuple, vision_tokens: int) -> None:
    layout = kimi.describe(width=size[0], height=size[1], config=kimi.preset("kimi_k25"))
    assert (layout.resized, layout.grid_thw, layout.num_vision_tokens) == (resized, grid, vision_tokens)
    # The expanded prompt's count, as every Kimi processor makes it.
    assert layout.num_placeholder_tokens == vision_tokens
    assert kimi.payload(layout) == {"grid_thws": [list(grid)]}


def test_kimi_layout_invariants_over_a_grid_of_sizes() -> None:
    config = KimiK25Config(in_patch_limit=1024, patch_limit_on_one_side=64)
    side_limit, factor = 64 * 14, 28
    for width in (1, 13, 14, 27, 28, 29, 100, 447, 448, 449, 1000, 3000, 20000):
        for height in (1, 14, 29, 300, 896, 897, 5000):
            layout = kimi.describe(width=width, height=height, config=config)
            new_h, new_w = layout.resized
            assert 1 <= new_w <= min(width, side_limit) and 1 <= new_h <= min(height, side_limit)
            assert (new_w // 14) * (new_h // 14) <= config.in_patch_limit
            _, grid_h, grid_w = layout.grid_thw
            assert grid_h * 14 % factor == 0 and grid_w * 14 % factor == 0
            assert 0 <= grid_w * 14 - new_w < factor and 0 <= grid_h * 14 - new_h < factor


def test_kimi_config_sources(tmp_path: Path) -> None:
    assert kimi.config_from_mapping({"merge_kernel_size": [2, 2]}) == KimiK25Config()
    with pytest.raises(ValueError, match="non-square"):
        kimi.config_from_mapping({"merge_kernel_size": [2, 4]})
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        kimi.config_from_mapping({"fixed_output_tokens": 64})

    class MediaProcessor:
        media_proc_cfg = KIMI_K25_PUBLIC["media_proc_cfg"]

    class Processor:
        media_processor = MediaProcessor()

    assert kimi.config_from_processor(Processor()) == kimi.preset("kimi_k25")
    with pytest.raises(ValueError, match="media_proc_cfg"):
        kimi.config_from_processor(object())


def test_qwen_config_rejects_non_resizing_processors() -> None:
    class Processor:
        do_resize = False

    with pytest.raises(ValueError, match="do_resize"):
        qwen.config_from_processor(Processor())
    assert isinstance(qwen.preset("qwen2_vl"), QwenVLConfig)
