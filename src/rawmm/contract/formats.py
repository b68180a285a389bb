"""The image formats rawmm opens, and the one way it opens an image: with vLLM's allow-list for untrusted media.

The list is vLLM's ``vllm.multimodal.image.ALLOWED_IMAGE_FORMATS``, kept here rather than imported (ingest and
the trainer run without vLLM) and held equal to the installed vLLM's by tests/contract/test_formats.py: a file
vLLM refuses, rawmm refuses too. Denied: EPS (its loader runs Ghostscript on the file's PostScript), WMF, and
PIL's stub or identify-only readers (BUFR, GRIB, HDF5, MPEG).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

from PIL import Image, ImageFile, UnidentifiedImageError

ALLOWED_IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF",
    "BLP",
    "BMP",
    "CUR",
    "DCX",
    "DDS",
    "DIB",
    "FITS",
    "FLI",
    "FTEX",
    "GBR",
    "GIF",
    "ICNS",
    "ICO",
    "IM",
    "IMT",
    "IPTC",
    "JPEG",
    "JPEG2000",
    "MCIDAS",
    "MSP",
    "PCD",
    "PCX",
    "PIXAR",
    "PNG",
    "PPM",
    "PSD",
    "QOI",
    "SGI",
    "SPIDER",
    "SUN",
    "TGA",
    "TIFF",
    "WEBP",
    "XBM",
    "XPM",
    "XVTHUMB",
)

# How much of a file PIL's plugins look at to recognise their format.
_PREFIX_BYTES = 16


class DeniedImageFormat(UnidentifiedImageError):
    """An image in a format PIL reads but the allow-list denies."""


def denied_format(prefix: bytes) -> str | None:
    """The denied format whose PIL plugin recognises ``prefix`` (a file's first bytes), or None. Only the
    plugins' byte checks run: nothing of the file is parsed."""
    Image.init()  # every plugin registered (once), the denied ones included
    for name, (_, accept) in Image.OPEN.items():
        if name in ALLOWED_IMAGE_FORMATS or accept is None:
            continue
        try:
            result = accept(prefix)
        except (SyntaxError, IndexError, TypeError, struct.error):  # as PIL's own open: not this format
            continue
        if result and not isinstance(result, str):  # PIL reads a string as "not this format, because …"
            return name
    return None


# Keyed by the plugin registry's size: the tuple is built again only when a plugin registers or goes, not
# on every open (building it took ~25 us under the GIL, as much as a miss's whole PNG header parse).
_registered: dict[tuple[int, int], tuple[str, ...]] = {}


def registered_allowed_formats() -> tuple[str, ...]:
    """The allowed formats this Pillow has readers for, in PIL's own order (its registration order, which
    ``Image.open`` tries without a list: PNG and JPEG first). ``Image.open`` fails with a ``KeyError`` on a
    listed format it lacks (AVIF came with Pillow 11.2), and tries a list in the order given: in the
    allow-list's alphabetical order a PNG waited for 24 other plugins (IMT, which has no byte check, even
    parses the header), 65 instead of 27 us under the GIL a miss."""
    Image.init()
    key = (len(Image.ID), len(Image.OPEN))
    formats = _registered.get(key)
    if formats is None:
        allowed = frozenset(ALLOWED_IMAGE_FORMATS)
        formats = _registered[key] = tuple(
            name for name in Image.ID if name in allowed and name in Image.OPEN
        )
    return formats


def open_allowed(source: bytes | Path) -> ImageFile.ImageFile:
    """``Image.open`` of encoded bytes or a file, limited to ``ALLOWED_IMAGE_FORMATS`` (header only, as
    ``Image.open`` is). A format the list denies raises ``DeniedImageFormat`` naming it; one PIL does not know
    raises ``UnidentifiedImageError`` as ever."""
    try:
        return Image.open(
            io.BytesIO(source) if isinstance(source, bytes) else source, formats=registered_allowed_formats()
        )
    except UnidentifiedImageError:
        if isinstance(source, bytes):
            prefix = source[:_PREFIX_BYTES]
        else:
            with source.open("rb") as file:
                prefix = file.read(_PREFIX_BYTES)
        denied = denied_format(prefix)
        if denied is None:
            raise
        raise DeniedImageFormat(
            f"{denied} is not an allowed image format (the allow-list vLLM opens untrusted images with)"
        ) from None
