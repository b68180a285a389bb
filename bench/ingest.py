"""Ingest throughput: ``OffloadStore.put`` vs a bare sha256 + file write of the same bytes (goal >= 0.8).

Both sides get the same encoded images (screenshot-like PNGs and photo-like JPEGs), each round into
fresh directories on the same filesystem, sides alternating; the median round of each side counts.
The headline ratio is for a store in use (its 256 fan-out directories exist, as they do after the
first few hundred images of a run); a store's first use, which also creates those directories, is
reported next to it.
``put`` additionally identifies the format from the header, fans out into ``<sha[:2]>/`` directories
and publishes atomically (temporary file + ``os.replace``). Re-ingesting stored bytes (hash + touch) is
reported too.

    .venv/bin/python bench/ingest.py [--images 48] [--rounds 9] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw

from rawmm.contract import OffloadStore


def screenshot(seed: int) -> bytes:
    """A 1280x720 UI-like PNG: flat panels, text-like strokes and a noisy thumbnail (~0.3-0.6 MB)."""
    rng = random.Random(seed)
    image = Image.new("RGB", (1280, 720), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.randrange(1200), rng.randrange(680)
        draw.rectangle(
            (x, y, x + rng.randrange(20, 400), y + rng.randrange(10, 200)), fill=rng.randrange(1 << 24)
        )
    for row in range(0, 720, 18):
        draw.text((rng.randrange(40), row), " ".join(f"{rng.random():.6f}" for _ in range(12)), fill=0)
    image.paste(Image.frombytes("RGB", (240, 160), rng.randbytes(240 * 160 * 3)), (rng.randrange(1000), 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def photo(seed: int) -> bytes:
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (64, 48), rng.randbytes(64 * 48 * 3)).resize(
        (1024, 768), Image.Resampling.BICUBIC
    )
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def bare_write(images: list[bytes], directory: Path) -> None:
    for data in images:
        (directory / f"{hashlib.sha256(data).hexdigest()}.png").write_bytes(data)


def store_put(images: list[bytes], directory: Path) -> None:
    store = OffloadStore(directory)
    for data in images:
        store.put(data)


def timed_round(
    side: Callable[[list[bytes], Path], None], images: list[bytes], base: Path, warm: bool
) -> float:
    directory = Path(tempfile.mkdtemp(dir=base))
    if warm and side is store_put:  # a store in use already has its 256 fan-out directories
        for i in range(256):
            (directory / f"{i:02x}").mkdir()
    try:
        start = time.perf_counter()
        side(images, directory)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    images = [screenshot(i) if i % 4 else photo(i) for i in range(args.images)]
    total_mb = sum(map(len, images)) / 1e6
    base = Path(tempfile.mkdtemp(prefix="rawmm-bench-ingest-", dir=args.dir))
    try:
        bare, ours, cold = [], [], []
        for round_ in range(args.rounds):
            sides = [(bare, bare_write, True), (ours, store_put, True), (cold, store_put, False)]
            for times, side, warm in sides if round_ % 2 == 0 else sides[::-1]:
                times.append(timed_round(side, images, base, warm))
        store = OffloadStore(base / "reuse")
        store_put(images, store.root)
        start = time.perf_counter()
        for data in images:
            store.put(data)
        reuse = time.perf_counter() - start
    finally:
        shutil.rmtree(base)

    bare_s, ours_s, cold_s = statistics.median(bare), statistics.median(ours), statistics.median(cold)
    ratio = bare_s / ours_s
    print(f"{len(images)} new images, {total_mb:.1f} MB, median of {args.rounds} rounds")
    print(f"bare sha256 + write       : {bare_s * 1e3:8.1f} ms  {total_mb / bare_s:8.1f} MB/s")
    print(
        f"OffloadStore.put          : {ours_s * 1e3:8.1f} ms  {total_mb / ours_s:8.1f} MB/s  (store in use)"
    )
    print(
        f"OffloadStore.put, 1st use : {cold_s * 1e3:8.1f} ms  {total_mb / cold_s:8.1f} MB/s  (creates fan-out dirs)"
    )
    print(f"re-ingest (hash + touch)  : {reuse * 1e3:8.1f} ms  {total_mb / reuse:8.1f} MB/s")
    print(f"ratio put / bare          : {ratio:.2f}  (goal >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'})")
    print(f"ratio put (1st use) / bare: {bare_s / cold_s:.2f}")


if __name__ == "__main__":
    main()
