"""Layout math vs running the image processor on the same images (expect >= 100x faster).

For typical screenshot and photo sizes, ``family.describe`` (width, height, config -> grid and token
count) is timed against transformers' Qwen image processor (PIL and torchvision backends) producing
``image_grid_thw`` for the same images, at the public Qwen2-VL and Qwen3-VL configs. The grids are
checked to agree while timing.

    .venv/bin/python bench/layout.py [--images 16] [--describe-repeats 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from PIL import Image

from rawmm.contract import get_family

SIZES = [
    (1280, 720),
    (1920, 1080),
    (1366, 768),
    (2560, 1440),
    (800, 600),
    (1024, 1024),
    (3024, 4032),
    (390, 844),
]


def processor(preset: str, backend: str) -> Any:
    from rawmm.materialize import qwen_image_processor

    return qwen_image_processor(get_family("qwen_vl").preset(preset), backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--describe-repeats", type=int, default=2000)
    args = parser.parse_args()

    rng = random.Random(0)
    sizes = [rng.choice(SIZES) for _ in range(args.images)]
    images = [Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)) for size in sizes]
    qwen = get_family("qwen_vl")
    print(f"{len(images)} images of sizes {sorted(set(sizes))}")
    for preset in ("qwen2_vl", "qwen3_vl"):
        config = qwen.preset(preset)
        qwen.describe(width=1, height=1, config=config)  # first call imports the resize function
        start = time.perf_counter()
        for _ in range(args.describe_repeats):
            layouts = [qwen.describe(width=w, height=h, config=config) for w, h in sizes]
        describe_s = (time.perf_counter() - start) / args.describe_repeats / len(sizes)
        for backend in ("pil", "torchvision"):
            image_processor = processor(preset, backend)
            image_processor(images=images[:1])  # warm-up
            per_image = []
            for image, layout in zip(images, layouts, strict=True):
                start = time.perf_counter()
                grid = image_processor(images=[image])["image_grid_thw"][0]
                per_image.append(time.perf_counter() - start)
                assert tuple(int(v) for v in grid) == layout.grid_thw
            processor_s = statistics.mean(per_image)
            print(
                f"{preset:9s} {backend:11s}: describe {describe_s * 1e6:6.2f} us/image, "
                f"processor {processor_s * 1e3:8.2f} ms/image, ratio {processor_s / describe_s:10.0f}x "
                f"(goal >= 100x: {'met' if processor_s / describe_s >= 100 else 'NOT met'})"
            )
    kimi = get_family("kimi_k25")
    config = kimi.preset("kimi_k25")
    start = time.perf_counter()
    for _ in range(args.describe_repeats):
        for w, h in sizes:
            kimi.describe(width=w, height=h, config=config)
    kimi_s = (time.perf_counter() - start) / args.describe_repeats / len(sizes)
    print(f"kimi_k25  describe {kimi_s * 1e6:6.2f} us/image (no Kimi processor installed to compare against)")


if __name__ == "__main__":
    main()
