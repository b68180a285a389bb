"""The confined, hash-verified, bomb-checked read of an offloaded image (engine and trainer alike).

Order matters: resolve the URI inside the offload root(s) before touching the file, verify the bytes'
sha256 against the ref's hash before parsing them (both done by the store's ``read_verified``), and
check the image's size from its header before decoding pixels, so a hostile ref can neither read
outside the volume nor make us decode a bomb.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias, cast

import cv2
import numpy as np
import numpy.typing as npt
from PIL import ImageFile

from rawmm.contract import InvalidImageRef, RawImageDescriptor, RawImageRef
from rawmm.contract.refs import check_mm_hash
from rawmm.contract.store import read_verified
from rawmm.materialize.decode import DEFAULT_MAX_IMAGE_PIXELS, displayed_rgb, open_image

# Any PNG decoder gives the file's own pixels for plain PNGs; OpenCV's releases the GIL and hands back an
# array, where PIL holds the GIL to copy its pixels out (~1 ms a screenshot, all of a miss that two worker
# threads could not overlap). RGBA comes back as BGRA.
_OPENCV_FLAGS = {"RGB": cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION, "RGBA": cv2.IMREAD_UNCHANGED}
# Chunks after which PIL's pixels may differ from another decoder's: EXIF or XMP, whose orientation PIL
# applies (EXIF may also sit in a text chunk), and animation (which frame shows is the decoder's choice).
_CHUNKS_FOR_PIL = frozenset({b"eXIf", b"acTL"})
_TEXT_CHUNKS = frozenset({b"tEXt", b"zTXt", b"iTXt"})
_KEYWORDS_FOR_PIL = (b"Raw profile type exif\x00", b"XML:com.adobe.xmp\x00")

RgbPixels: TypeAlias = npt.NDArray[np.uint8]
"""An image as displayed: ``(height, width, 3)`` uint8 RGB, rows top to bottom."""


def png_chunks_need_pil(data: bytes) -> bool:
    """Whether a PNG's chunk list (walked header to header: a few dozen steps, where scanning the bytes for
    markers would cost a third of a millisecond under the GIL) has a chunk only PIL renders as displayed;
    a list that does not end in IEND counts as one too."""
    offset = 8  # past the signature
    while offset + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, offset)
        if kind == b"IEND":
            return False
        if kind in _CHUNKS_FOR_PIL:
            return True
        if kind in _TEXT_CHUNKS and data.startswith(_KEYWORDS_FOR_PIL, offset + 8):
            return True
        offset += 12 + length  # length, type, data, CRC
    return True


def plain_png(opened: ImageFile.ImageFile, data: bytes) -> bool:
    """An 8-bit RGB or RGBA PNG with no EXIF, XMP or animation: what it displays is what it stores, once an
    RGBA one turns out opaque (a transparent colour leaves RGB pixels as they are, in PIL and in vLLM's
    loader alike)."""
    return (
        opened.format == "PNG"
        and opened.mode in _OPENCV_FLAGS
        and bool(opened.tile)
        and opened.tile[0].args == opened.mode  # 8 bits a channel, not "RGB;16B", which PIL narrows itself
        and not png_chunks_need_pil(data)
    )


def opencv_pixels(data: bytes, opened: ImageFile.ImageFile) -> RgbPixels | None:
    """A plain PNG decoded by OpenCV as displayed RGB pixels; None where PIL must decide: OpenCV refused the
    file, or an RGBA image is not opaque (PIL composites it over white, with its own rounding)."""
    try:
        pixels = cv2.imdecode(np.frombuffer(data, np.uint8), _OPENCV_FLAGS[opened.mode])
    except cv2.error:
        return None
    if pixels is None or pixels.shape != (opened.height, opened.width, len(opened.mode)):
        return None
    if opened.mode == "RGBA":
        if pixels[..., 3].min() != 255:
            return None
        pixels = cv2.cvtColor(pixels, cv2.COLOR_BGRA2RGB)
    return cast(RgbPixels, pixels)


@dataclass(frozen=True)
class OpenedImage:
    """An image file's verified bytes and its header, its size within the pixel limit; nothing decoded yet."""

    data: bytes = field(repr=False)  # up to the file limit: never in a log line
    header: ImageFile.ImageFile
    source: str

    @property
    def pixels(self) -> int:
        """Width x height, from the header: what decoding it will hold."""
        width, height = self.header.size
        return width * height

    def decode(self) -> RgbPixels:
        """The displayed RGB pixels, exactly PIL's (hence vLLM's own loader's). A plain PNG (screenshots)
        decodes with OpenCV, off the GIL; anything else, or a PNG OpenCV cannot show as PIL would, goes
        through PIL, which has the last word."""
        if (
            plain_png(self.header, self.data)
            and (pixels := opencv_pixels(self.data, self.header)) is not None
        ):
            return pixels
        return np.array(displayed_rgb(self.header, source=self.source))


def decode_pixels(data: bytes, *, max_pixels: int, source: str) -> RgbPixels:
    """Encoded bytes as displayed RGB pixels, refusing images over ``max_pixels`` before decoding."""
    return OpenedImage(data, open_image(data, max_pixels=max_pixels, source=source), source).decode()


def open_ref_image(
    ref_or_descriptor: RawImageRef | RawImageDescriptor,
    *,
    mm_hash: str,
    roots: Sequence[Path],
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> OpenedImage:
    """The image a ref (or descriptor) points to, read only inside ``roots`` (resolved directories: a root
    given through a symlink confines to nothing), verified against ``mm_hash`` and its header checked, ready
    to decode: a caller can admit its pixels before they exist.

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
    data = read_verified(uri, mm_hash, roots)
    return OpenedImage(data, open_image(data, max_pixels=max_pixels, source=uri), uri)


def read_ref_image(
    ref_or_descriptor: RawImageRef | RawImageDescriptor,
    *,
    mm_hash: str,
    roots: Sequence[Path],
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> RgbPixels:
    """The pixels of the image a ref (or descriptor) points to: ``open_ref_image``, decoded (same errors)."""
    return open_ref_image(ref_or_descriptor, mm_hash=mm_hash, roots=roots, max_pixels=max_pixels).decode()
