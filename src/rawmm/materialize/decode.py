"""An image's bytes decoded the way vLLM's own image loader decodes them (PIL only, nothing heavy: ``rawmm
ingest`` checks files with it on any install).

The size comes from the header and is checked before any pixel is decoded, so a bomb is refused unread.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from rawmm.contract import InvalidImageRef
from rawmm.contract.formats import open_allowed

# A 4K screenshot is ~8.3M pixels; anything past this is a bomb, not a picture worth decoding.
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024


@contextmanager
def decoding(source: str) -> Iterator[None]:
    """PIL's errors while opening or decoding ``source`` as ``InvalidImageRef`` (``image_too_large`` for a
    bomb, ``decode_error`` for anything else)."""
    try:
        with warnings.catch_warnings():
            # PIL warns (and past twice its limit, raises) on bombs; our own limit is the one that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except InvalidImageRef:
        raise
    except Image.DecompressionBombError as exc:
        raise InvalidImageRef("image_too_large", f"{source}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidImageRef("decode_error", f"{source} is not a decodable image: {exc}") from None


def open_image(data: bytes, *, max_pixels: int, source: str) -> ImageFile.ImageFile:
    """The image's header, refused when its format is not one vLLM opens (``ALLOWED_IMAGE_FORMATS``) or it has
    more than ``max_pixels`` pixels (no pixel decoded yet)."""
    with decoding(source):
        opened = open_allowed(data)
    width, height = opened.size
    if width * height > max_pixels:
        raise InvalidImageRef(
            "image_too_large", f"{source} is {width}x{height}, over the {max_pixels}-pixel limit"
        )
    return opened


def exif_oriented(image: Image.Image) -> Image.Image:
    """``image`` turned as its EXIF orientation says (unchanged without one, or with a broken EXIF block)."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - a broken EXIF block leaves the pixels as stored, as vLLM does
        return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels, with transparency (an alpha channel, or a palette or grey PNG's transparent colour)
    composited over white: what vLLM's own image path does, so raw refs and data URLs of one image reach the
    model identically (a plain ``convert("RGB")`` would drop the alpha and show what lies under it). An RGB
    image is returned as it is, its transparent colour included, as vLLM does."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")


def displayed_rgb(opened: Image.Image, *, source: str) -> Image.Image:
    """An opened image decoded as displayed: EXIF orientation first, then RGB over white where transparent
    (vLLM's order)."""
    with decoding(source):
        image = exif_oriented(opened)
        image.load()
        return to_rgb(image)


def decode_image(data: bytes, *, max_pixels: int, source: str) -> Image.Image:
    """Decode encoded bytes to an RGB image as displayed, refusing images over ``max_pixels`` before decoding."""
    return displayed_rgb(open_image(data, max_pixels=max_pixels, source=source), source=source)
