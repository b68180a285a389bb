"""The uint8 miss path (our patchify on transformers' resize, fed decoded RGB rows) gives transformers'
torchvision output for the PIL image, bit for bit (the PIL image is what vLLM's own path hands transformers)."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvf
from transformers.image_utils import PILImageResampling

from rawmm.contract import OffloadStore, resolve_preset
from rawmm.materialize import get_adapter, load_processor, materialize_engine_item, qwen_image_processor
from rawmm.materialize.qwen_uint8 import patchify, resize_bicubic, uint8_patches
from rawmm.materialize.workers import usable_cpus


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def rows(images: list[Image.Image]) -> list[np.ndarray]:
    """The images as our read decodes them: RGB rows."""
    return [np.array(image.convert("RGB")) for image in images]


def hf_uint8(processor: object, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    out = processor(images=images, return_tensors="pt", do_rescale=False, do_normalize=False)  # type: ignore[operator]
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("preset", ["qwen2_vl", "qwen3_vl"])  # patch 14 and 16
@pytest.mark.parametrize(
    "size",
    [
        (1280, 720),  # the screenshot the miss-path goal is about
        (37, 29),  # below min_pixels: upscaled
        (3000, 41),  # a strip
        (333, 777),  # odd, portrait
    ],
)
def test_uint8_patches_equal_transformers_torchvision_output(preset: str, size: tuple[int, int]) -> None:
    _, config = resolve_preset(preset)
    processor = qwen_image_processor(config, "torchvision")
    image = noise_image(*size, seed=size[0])
    assert_identical(uint8_patches(processor, rows([image])), hf_uint8(processor, [image]))


def test_a_batch_of_mixed_sizes_and_modes_keeps_transformers_order(tiny_qwen2_vl: Path) -> None:
    # The tiny checkpoint's low max_pixels makes every image here a downscale; a grey one decodes to RGB.
    processor = load_processor(tiny_qwen2_vl, "torchvision").processor
    images = [noise_image(300, 200, 1), noise_image(120, 90, 2), noise_image(300, 200, 3)]
    images.append(noise_image(64, 96, 4).convert("L").convert("RGB"))
    assert_identical(uint8_patches(processor, rows(images)), hf_uint8(processor, images))


def test_temporal_patch_size_one_and_other_merge_sizes() -> None:
    _, config = resolve_preset("qwen2_vl")
    for temporal, merge in ((1, 2), (3, 1)):
        processor = qwen_image_processor(
            replace(config, temporal_patch_size=temporal, merge_size=merge), "torchvision"
        )
        image = noise_image(211, 143, seed=temporal)
        assert_identical(uint8_patches(processor, rows([image])), hf_uint8(processor, [image]))


def test_a_processor_resampling_otherwise_than_bicubic_keeps_transformers_resize() -> None:
    # The direct kernel call is bicubic's only: a bilinear checkpoint goes through transformers' resize.
    _, config = resolve_preset("qwen2_vl")
    processor = qwen_image_processor(config, "torchvision")
    processor.resample = PILImageResampling.BILINEAR
    image = noise_image(1280, 720)
    assert_identical(uint8_patches(processor, rows([image])), hf_uint8(processor, [image]))


@pytest.mark.parametrize("layout", ["channels last", "contiguous"])
@pytest.mark.parametrize("size", [(364, 644), (720, 1280), (1092, 1932)])  # down, unchanged, up
def test_the_bicubic_resize_is_torchvisions_on_any_strides(layout: str, size: tuple[int, int]) -> None:
    hwc = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (720, 1280, 3), dtype=np.uint8))
    chw = hwc.permute(2, 0, 1) if layout == "channels last" else hwc.permute(2, 0, 1).contiguous()
    want = tvf.resize_image(chw, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
    got = resize_bicubic(chw, *size)
    assert torch.equal(got, want) and got.stride() == want.stride()


def test_patchify_reads_any_strides() -> None:
    # A channels-last view (what the resize returns) and a contiguous copy give the same rows.
    hwc = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    rows = patchify(hwc.permute(2, 0, 1), patch=14, merge=2, temporal=2)
    assert torch.equal(rows, patchify(hwc.permute(2, 0, 1).contiguous(), patch=14, merge=2, temporal=2))
    assert rows.shape == (4 * 6, 3 * 2 * 14 * 14) and rows.is_contiguous()


def test_the_engine_item_on_the_uint8_torchvision_path_is_transformers_output(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(tiny_qwen2_vl, "torchvision", pixels="uint8")
    image = noise_image(150, 100)
    ref = make_ref(image, loaded)
    item = materialize_engine_item(
        ref,
        placeholder_length=ref.payload["image_grid_thw"][0][1] * ref.payload["image_grid_thw"][0][2] // 4,
        processor=loaded,
        roots=[offload_store.root],
        max_pixels=10**8,
    )
    want = hf_uint8(loaded.processor, [image])
    assert torch.equal(item.tensors["pixel_values"], want["pixel_values"])
    assert item.tensors["pixel_values"].dtype == torch.uint8
    assert torch.equal(item.tensors["image_grid_thw"], want["image_grid_thw"][0])
    # The trainer's uint8 batches take the same path.
    assert_identical(get_adapter("qwen_vl")._process(loaded.processor, rows([image]), normalize=False), want)


ONE_THREAD_PROBE = """
import threading, time, numpy as np, torch
from rawmm.contract import resolve_preset
from rawmm.materialize import get_adapter, qwen_image_processor
torch.set_num_threads(2)  # intra-op threads available, as in an engine process
processor = qwen_image_processor(resolve_preset("qwen2_vl")[1], "torchvision")
image = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), dtype=np.uint8)
adapter = get_adapter("qwen_vl")
def run():
    adapter._process(processor, [image], normalize=False)
    process, thread = time.process_time(), time.thread_time()
    for _ in range(5):
        adapter._process(processor, [image], normalize=False)
    print(time.process_time() - process, time.thread_time() - thread)
worker = threading.Thread(target=run)
worker.start()
worker.join()
"""


@pytest.mark.slow
def test_a_uint8_miss_uses_its_worker_thread_alone() -> None:
    # Worker threads materialize in parallel, one core each: the path must not fan out into torch's
    # intra-op threads (transformers' patchify does: as much CPU again in helper threads, mostly spinning).
    # CPU time is what is compared, so other load on the machine does not change the outcome.
    out = subprocess.run([sys.executable, "-c", ONE_THREAD_PROBE], capture_output=True, text=True, check=True)
    process_cpu, thread_cpu = map(float, out.stdout.split())
    assert process_cpu - thread_cpu < 0.1 * thread_cpu, (process_cpu, thread_cpu)


@pytest.mark.skipif(usable_cpus() < 2, reason="two misses can overlap only on two CPUs")
def test_two_misses_on_two_threads_keep_two_cpus_busy(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    # A miss holds the GIL for a small part of its work (decode, resize and patchify release it), so two
    # misses on two threads run on two CPUs at once: process CPU time / wall time ~1.8 on two idle CPUs,
    # at most ~1.0 for a path that holds the GIL or a lock throughout. Best of five bursts: a busy machine
    # can take a CPU away for one burst, but cannot lift a GIL-bound path above one.
    loaded = load_processor(tiny_qwen2_vl, "torchvision", pixels="uint8")
    misses = []
    for seed in (1, 2):
        ref = make_ref(noise_image(1280, 720, seed=seed), loaded)
        grid = ref.payload["image_grid_thw"][0]
        misses.append(
            functools.partial(
                materialize_engine_item,
                ref,
                placeholder_length=grid[1] * grid[2] // 4,
                processor=loaded,
                roots=[offload_store.root],
                max_pixels=10**8,
            )
        )
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda miss: miss(), misses))  # warm-up: both threads
        parallelism = []
        for _ in range(5):
            wall, cpu = time.perf_counter(), time.process_time()
            list(pool.map(lambda miss: miss(), misses * 4))
            parallelism.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    assert max(parallelism) >= 1.4, parallelism
