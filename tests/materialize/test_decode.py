"""Decoding an image's bytes as displayed (`rawmm.materialize.decode`): the size checked from the header
before any pixel, EXIF orientation, transparency over white, and PIL's errors as the contract's reasons."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from rawmm.contract import InvalidImageRef
from rawmm.materialize.decode import decode_image, decoding, displayed_rgb, exif_oriented, open_image, to_rgb


def encoded(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` RGB pixels and holds none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def noise(width: int, height: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def refusal(excinfo: pytest.ExceptionInfo[InvalidImageRef]) -> tuple[str, str]:
    return excinfo.value.reason, excinfo.value.message


def test_an_rgb_image_decodes_to_its_own_pixels() -> None:
    pixels = noise(7, 5)
    image = decode_image(encoded(Image.fromarray(pixels)), max_pixels=35, source="a.png")
    assert image.mode == "RGB" and image.size == (7, 5)
    assert np.array_equal(np.asarray(image), pixels)


def test_a_grey_image_decodes_to_rgb() -> None:
    grey = noise(4, 3, channels=1)
    image = decode_image(encoded(Image.fromarray(grey, mode="L")), max_pixels=100, source="g.png")
    assert image.mode == "RGB"
    assert np.array_equal(np.asarray(image), np.repeat(grey[..., None], 3, axis=2))


def test_transparency_is_composited_over_white() -> None:
    rgba = np.array([[[10, 20, 30, 255], [10, 20, 30, 0], [200, 100, 0, 128]]], dtype=np.uint8)
    image = decode_image(encoded(Image.fromarray(rgba, mode="RGBA")), max_pixels=100, source="t.png")
    shown = np.asarray(image)
    assert shown[0, 0].tolist() == [10, 20, 30]  # opaque: as stored
    assert shown[0, 1].tolist() == [255, 255, 255]  # transparent: white, not the colour stored under it
    # Half transparent: halfway to white, as PIL's paste with the alpha as mask blends it.
    assert np.abs(shown[0, 2].astype(int) - [227, 177, 127]).max() <= 1


def test_grey_with_alpha_and_a_palette_transparent_index_are_shown_over_white() -> None:
    la = Image.fromarray(np.array([[[40, 255], [40, 0]]], dtype=np.uint8), mode="LA")
    assert np.asarray(to_rgb(la)).tolist() == [[[40, 40, 40], [255, 255, 255]]]
    palette = Image.fromarray(np.array([[0, 1]], dtype=np.uint8), mode="P")
    palette.putpalette([255, 0, 0, 0, 0, 255])
    palette.info["transparency"] = 1
    assert np.asarray(to_rgb(palette)).tolist() == [[[255, 0, 0], [255, 255, 255]]]


def test_an_rgb_images_transparent_colour_leaves_its_pixels_as_stored() -> None:
    """vLLM's loader keeps an RGB image's pixels whatever its tRNS chunk says; so do we."""
    rgb = Image.new("RGB", (3, 2), (1, 2, 3))
    data = encoded(rgb, transparency=(1, 2, 3))
    assert "transparency" in Image.open(io.BytesIO(data)).info
    image = decode_image(data, max_pixels=100, source="k.png")
    assert np.array_equal(np.asarray(image), np.asarray(rgb))
    assert to_rgb(rgb) is rgb


def test_the_exif_orientation_turns_the_image_as_displayed() -> None:
    pixels = noise(7, 5, seed=1)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise
    image = decode_image(encoded(Image.fromarray(pixels), exif=exif.tobytes()), max_pixels=35, source="r.png")
    assert image.size == (5, 7)
    assert np.array_equal(np.asarray(image), np.rot90(pixels, k=-1))


def test_a_broken_exif_block_leaves_the_pixels_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    image = Image.fromarray(noise(4, 3))

    def broken(image: Image.Image) -> Image.Image:
        raise SyntaxError("not a TIFF file")  # what PIL raises on a corrupt EXIF block

    monkeypatch.setattr(ImageOps, "exif_transpose", broken)
    assert exif_oriented(image) is image


def test_the_pixel_limit_is_checked_from_the_header_before_decoding() -> None:
    data = encoded(Image.fromarray(noise(7, 5)))
    assert open_image(data, max_pixels=35, source="a.png").size == (7, 5)
    with pytest.raises(InvalidImageRef) as excinfo:
        open_image(data, max_pixels=34, source="a.png")
    assert refusal(excinfo) == ("image_too_large", "a.png is 7x5, over the 34-pixel limit")
    # A header alone is refused the same way: nothing was decoded to find its size.
    with pytest.raises(InvalidImageRef) as excinfo:
        decode_image(png_header_only(30_000, 30_000), max_pixels=10**8, source="bomb.png")
    assert excinfo.value.reason == "image_too_large"


def test_past_pils_own_bomb_limit_an_image_is_too_large_whatever_our_limit() -> None:
    width = height = 20_000  # 400M pixels: over twice PIL's MAX_IMAGE_PIXELS, where PIL itself raises
    assert width * height > 2 * Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidImageRef) as excinfo:
        open_image(png_header_only(width, height), max_pixels=10**12, source="huge.png")
    assert excinfo.value.reason == "image_too_large"
    assert excinfo.value.message.startswith("huge.png: ")


def test_pils_bomb_warning_is_not_ours_to_give() -> None:
    """Between PIL's limit and twice it, PIL warns; our own limit is the one that counts."""
    side = 10_000  # 100M pixels
    assert Image.MAX_IMAGE_PIXELS < side * side < 2 * Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_image(png_header_only(side, side), max_pixels=side * side, source="big.png").size == (
            side,
            side,
        )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "cannot identify image file"),
        (b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10, "is not a decodable image"),
        (encoded(Image.new("RGB", (4, 3), "red"), "EPS"), "EPS is not an allowed image format"),
    ],
    ids=["empty", "png signature then junk", "a format vLLM does not open"],
)
def test_bytes_that_open_as_no_allowed_image_are_a_decode_error(data: bytes, message: str) -> None:
    with pytest.raises(InvalidImageRef) as excinfo:
        decode_image(data, max_pixels=10**6, source="x.png")
    reason, text = refusal(excinfo)
    assert reason == "decode_error" and text.startswith("x.png is not a decodable image: ")
    assert message in text


def test_a_truncated_image_opens_but_is_a_decode_error_when_its_pixels_are_read() -> None:
    data = encoded(Image.fromarray(noise(64, 64, seed=2)))
    opened = open_image(data[: len(data) // 2], max_pixels=64 * 64, source="half.png")
    with pytest.raises(InvalidImageRef) as excinfo:
        displayed_rgb(opened, source="half.png")
    assert excinfo.value.reason == "decode_error" and excinfo.value.message.startswith(
        "half.png is not a decodable image"
    )


@pytest.mark.parametrize(
    "error", [OSError("io"), ValueError("value"), SyntaxError("syntax"), EOFError("eof")]
)
def test_decoding_turns_pils_errors_into_a_decode_error(error: Exception) -> None:
    with pytest.raises(InvalidImageRef) as excinfo, decoding("y.png"):
        raise error
    assert refusal(excinfo) == ("decode_error", f"y.png is not a decodable image: {error}")


def test_decoding_passes_a_refusal_and_a_stranger_error_through_as_they_are() -> None:
    refused = InvalidImageRef("image_too_large", "already refused")
    with pytest.raises(InvalidImageRef) as excinfo, decoding("y.png"):
        raise refused
    assert excinfo.value is refused
    with pytest.raises(RuntimeError, match="a bug, not a bad image"), decoding("y.png"):
        raise RuntimeError("a bug, not a bad image")
