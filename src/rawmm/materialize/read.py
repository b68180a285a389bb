"""The confined, hash-verified, bomb-checked read of an offloaded image (engine and trainer alike).

Order matters: resolve the URI inside the offload root(s) before touching the file, verify the bytes'
sha256 against the ref's hash before parsing them (both done by the store's ``read_verified``), and
check the image's size from its header before decoding pixels, so a hostile ref can neither read
outside the volume nor make us decode a bomb.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from rawmm.contract import InvalidImageRef, RawImageDescriptor, RawImageRef, resolve_uri
from rawmm.contract.refs import check_mm_hash
from rawmm.contract.store import read_verified

# A 4K screenshot is ~8.3M pixels; anything past this is a bomb, not a picture worth decoding.
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def exif_oriented(image: Image.Image) -> Image.Image:
    """``image`` turned as its EXIF orientation says (unchanged without one, or with a broken EXIF block)."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - a broken EXIF block leaves the pixels as stored, as vLLM does
        return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels, with transparency (an alpha channel, or a PNG's transparent colour) composited over white:
    what vLLM's own image path does, so raw refs and data URLs of one image reach the model identically
    (a plain ``convert("RGB")`` would drop the alpha and show what lies under it)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")


def decode_image(data: bytes, *, max_pixels: int, source: str) -> Image.Image:
    """Decode encoded bytes to an RGB image as displayed (EXIF orientation applied, transparency over white),
    refusing images over ``max_pixels`` before decoding pixels."""
    try:
        with warnings.catch_warnings():
            # PIL warns (and past twice its limit, raises) on bombs; our own limit is the one that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data))
            width, height = opened.size
            if width * height > max_pixels:
                raise InvalidImageRef(
                    "image_too_large", f"{source} is {width}x{height}, over the {max_pixels}-pixel limit"
                )
            # As vLLM's own image loader does: orientation first, then RGB over white where transparent.
            image = exif_oriented(opened)
            image.load()
            return to_rgb(image)
    except InvalidImageRef:
        raise
    except Image.DecompressionBombError as exc:
        raise InvalidImageRef("image_too_large", f"{source}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidImageRef("decode_error", f"{source} is not a decodable image: {exc}") from None


def header_pixels(ref: RawImageRef | RawImageDescriptor, roots: Sequence[Path]) -> int | None:
    """Width x height from the image file's header (confined like a read, no hash check, no decode); None
    when it cannot be read, which the full read then reports with its reason."""
    try:
        path = resolve_uri(ref.raw_image_uri, roots)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
    except (
        InvalidImageRef,
        Image.DecompressionBombError,
        UnidentifiedImageError,
        OSError,
        ValueError,
        SyntaxError,
    ):
        return None
    return width * height


def read_ref_image(
    ref_or_descriptor: RawImageRef | RawImageDescriptor,
    *,
    mm_hash: str,
    roots: Sequence[Path],
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """The RGB image a ref (or descriptor) points to, read only inside ``roots`` and verified against ``mm_hash``.

    Raises ``InvalidImageRef`` with reason ``malformed_ref`` (``mm_hash`` is not a hash), ``hash_mismatch`` (the ref's own hash differs from ``mm_hash``,
    or the bytes do not hash to it), ``outside_offload_root``, ``missing_file``, ``unreadable_file``,
    ``image_too_large`` or ``decode_error``.
    """
    check_mm_hash(mm_hash)
    if isinstance(ref_or_descriptor, RawImageRef) and ref_or_descriptor.mm_hash != mm_hash:
        raise InvalidImageRef(
            "hash_mismatch", f"outer mm_hash {mm_hash} differs from the ref's {ref_or_descriptor.mm_hash}"
        )
    uri = ref_or_descriptor.raw_image_uri
    data = read_verified(uri, mm_hash, [Path(root).resolve() for root in roots])
    return decode_image(data, max_pixels=max_pixels, source=uri)
