"""Synthetic UI screenshots for the benches: flat panels, rows of text and a noisy thumbnail (PNG compresses
them about as well as real screenshots). Benches run as scripts, so they import this by its bare name."""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw


def screenshot_image(seed: int, width: int = 1280, height: int = 720) -> Image.Image:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(30):
        x, y = rng.randrange(width), rng.randrange(height)
        draw.rectangle(
            (x, y, x + rng.randrange(10, width // 3), y + rng.randrange(8, height // 4)),
            fill=rng.randrange(1 << 24),
        )
    for row in range(0, height, 16):
        draw.text(
            (rng.randrange(30), row), " ".join(f"{rng.random():.5f}" for _ in range(width // 80)), fill=0
        )
    thumb = Image.frombytes("RGB", (width // 6, height // 6), rng.randbytes((width // 6) * (height // 6) * 3))
    image.paste(thumb, (rng.randrange(width - width // 6), rng.randrange(height - height // 6)))
    return image


def screenshot_png(seed: int, width: int = 1280, height: int = 720) -> bytes:
    buffer = io.BytesIO()
    screenshot_image(seed, width, height).save(buffer, format="PNG")
    return buffer.getvalue()
