"""read_ref_image: confined to the offload root, verified against the hash, bombs refused before decoding."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import InvalidImageRef, OffloadStore, RawImageDescriptor, encode_ref, parse_ref
from rawmm.materialize import read as read_module
from rawmm.materialize.read import decode_pixels, open_ref_image, opencv_pixels, plain_png, read_ref_image


def descriptor(uri: str) -> RawImageDescriptor:
    return RawImageDescriptor(
        family="qwen_vl", modality="image", payload={"image_grid_thw": [[1, 2, 2]]}, raw_image_uri=uri
    )


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def reason_of(excinfo: pytest.ExceptionInfo[InvalidImageRef]) -> str:
    return excinfo.value.reason


def encoded(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def rotated_jpeg(orientation: int) -> bytes:
    """A 7x5 JPEG whose EXIF says to show it turned (6: 90° clockwise, so displayed 5x7)."""
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels), "JPEG", exif=rotated_exif(orientation).tobytes(), quality=95)


def transparent_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (5, 7, 4), dtype=np.uint8), mode="RGBA")
    la = Image.fromarray(rng.integers(0, 256, (5, 7, 2), dtype=np.uint8), mode="LA")
    palette = Image.fromarray(rng.integers(0, 4, (5, 7), dtype=np.uint8), mode="P")
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    return {
        "rgba": encoded(rgba),
        "la": encoded(la),
        "palette with a transparent index": encoded(palette, transparency=2),
        "rgb with a transparent colour": encoded(Image.new("RGB", (7, 5), (1, 2, 3)), transparency=(1, 2, 3)),
    }


def noise(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def with_chunks(png: bytes, *chunks: bytes) -> bytes:
    """``png`` with ``chunks`` inserted right after its IHDR (8-byte signature + 25-byte IHDR chunk)."""
    return png[:33] + b"".join(chunks) + png[33:]


def raw_png(rows: np.ndarray, bit_depth: int) -> bytes:
    """An RGB PNG written out by hand (PIL cannot write 16-bit RGB): unfiltered rows, big-endian samples."""
    height, width = rows.shape[:2]
    samples = rows.astype(">u2" if bit_depth == 16 else np.uint8).reshape(height, -1).tobytes()
    line = len(samples) // height
    scanlines = b"".join(b"\x00" + samples[i * line : (i + 1) * line] for i in range(height))
    header = struct.pack(">IIBBBBB", width, height, bit_depth, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(scanlines))
        + png_chunk(b"IEND", b"")
    )


def exif_text_chunk(orientation: int) -> bytes:
    """EXIF in a ``Raw profile type exif`` text chunk, where ImageMagick puts it (PIL reads it there too)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    block = b"Exif\x00\x00" + exif.tobytes()
    text = f"\nexif\n{len(block):8d}\n{block.hex()}\n".encode()
    return png_chunk(b"tEXt", b"Raw profile type exif\x00" + text)


def exif_after_pixels(png: bytes, orientation: int) -> bytes:
    """An eXIf chunk between the last IDAT and IEND (PIL finds it when it loads the pixels)."""
    exif = rotated_exif(orientation).tobytes().removeprefix(b"Exif\x00\x00")
    return png[:-12] + png_chunk(b"eXIf", exif) + png[-12:]


def xmp_chunk(orientation: int) -> bytes:
    """An iTXt XMP packet carrying an orientation, which PIL applies when EXIF has none."""
    packet = f'<x:xmpmeta><rdf:RDF><rdf:Description tiff:Orientation="{orientation}"/></rdf:RDF></x:xmpmeta>'
    return png_chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + packet.encode())


def animated_png() -> bytes:
    first, second = (Image.fromarray(noise(7, 5, seed)) for seed in (1, 2))
    return encoded(first, save_all=True, append_images=[second], duration=100)


# Plain 8-bit RGB and RGBA PNGs (screenshots) decode with OpenCV; these must give PIL's pixels, colour chunks
# and all. (A translucent RGBA one, "rgba" above, goes on to PIL for its composite over white.)
PLAIN_PNGS = {
    "plain rgb png": lambda: encoded(Image.fromarray(noise(53, 37))),
    "opaque rgba png": lambda: encoded(Image.fromarray(noise(53, 37, 9)).convert("RGBA")),
    "rgb png with colour chunks": lambda: with_chunks(
        encoded(Image.fromarray(noise(53, 37, 1))),
        png_chunk(b"gAMA", struct.pack(">I", 100_000)),
        png_chunk(b"sRGB", b"\x00"),
        png_chunk(b"sBIT", b"\x05\x06\x05"),
        png_chunk(b"cHRM", struct.pack(">8I", 31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000)),
    ),
    "rgb png with an icc profile": lambda: encoded(
        Image.fromarray(noise(20, 10, 2)), icc_profile=b"\x00" * 200
    ),
    # The transparent colour leaves RGB pixels as they are, in PIL (and vLLM's loader) too.
    "rgb png with a transparent colour": lambda: encoded(
        Image.fromarray(noise(7, 5, 6)), transparency=tuple(int(v) for v in noise(7, 5, 6)[0, 0])
    ),
}
# PNGs whose displayed pixels need PIL: they must not take the OpenCV path.
PNGS_FOR_PIL = {
    "16-bit rgb png": lambda: raw_png(noise(9, 6, 3).astype(np.uint16) * 257 + 3, 16),
    "rgb png with exif orientation 6": lambda: encoded(
        Image.fromarray(noise(7, 5, 4)), exif=rotated_exif(6).tobytes()
    ),
    "rgb png with exif in a text chunk": lambda: with_chunks(
        encoded(Image.fromarray(noise(7, 5, 5))), exif_text_chunk(8)
    ),
    "rgb png with exif after its pixels": lambda: exif_after_pixels(
        encoded(Image.fromarray(noise(7, 5, 7))), 6
    ),
    "rgb png with an xmp orientation": lambda: with_chunks(
        encoded(Image.fromarray(noise(7, 5, 8))), xmp_chunk(6)
    ),
    "animated png": animated_png,
}

# Allowed formats other than PNG and JPEG: PIL decodes them, as vLLM's loader does.
OTHER_FORMATS = {
    "bmp": lambda: encoded(Image.fromarray(noise(7, 5, 10)), "BMP"),
    "tiff": lambda: encoded(Image.fromarray(noise(7, 5, 11)), "TIFF"),
    "lossy webp": lambda: encoded(Image.fromarray(noise(16, 9, 12)), "WEBP", quality=80),
}


# The cases whose orientation turns the 7x5 image a quarter: stored, hence laid out, as 5x7.
QUARTER_TURNED = {
    "exif orientation 6",
    "exif orientation 8",
    *(name for name in PNGS_FOR_PIL if "exif" in name or "xmp" in name),
}


def rotated_exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def vllm_case(name: str) -> bytes:
    if name in transparent_images():
        return transparent_images()[name]
    if name.startswith("exif orientation"):
        return rotated_jpeg(int(name[-1]))
    return {**PLAIN_PNGS, **PNGS_FOR_PIL, **OTHER_FORMATS}[name]()


@pytest.mark.parametrize(
    "name",
    [
        *transparent_images(),
        "exif orientation 6",
        "exif orientation 3",
        "exif orientation 8",
        *PLAIN_PNGS,
        *PNGS_FOR_PIL,
        *OTHER_FORMATS,
    ],
)
def test_the_read_image_is_what_vllms_own_loader_makes_of_the_bytes(
    name: str, offload_store: OffloadStore
) -> None:
    """Raw refs must reach the model as data URLs of the same bytes do on vLLM: the same orientation, and
    transparency over white (not the colours under it); the stored size (hence the layout) is the displayed one.
    Whichever decoder reads it (OpenCV for plain RGB and opaque RGBA PNGs, PIL for the rest), the pixels are vLLM's."""
    from vllm.multimodal.media.image import ImageMediaIO

    data = vllm_case(name)
    stored = offload_store.put(data)
    ours = read_ref_image(descriptor(stored.uri), mm_hash=stored.mm_hash, roots=[offload_store.root])
    theirs = ImageMediaIO().load_bytes(data).media
    assert theirs.mode == "RGB" and ours.dtype == np.uint8
    assert ours.shape == (theirs.height, theirs.width, 3) == (stored.height, stored.width, 3)
    assert np.array_equal(ours, np.asarray(theirs))
    if name in QUARTER_TURNED:
        assert (stored.width, stored.height) == (5, 7)
    if name == "rgba":
        assert not np.array_equal(ours, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("name", [*PLAIN_PNGS, *PNGS_FOR_PIL])
def test_only_plain_pngs_take_the_opencv_decoder(name: str) -> None:
    data = {**PLAIN_PNGS, **PNGS_FOR_PIL}[name]()
    opened = Image.open(io.BytesIO(data))
    assert plain_png(opened, data) == (name in PLAIN_PNGS)
    if name in PLAIN_PNGS:  # and OpenCV does decode them (PIL's fallback would hide a failing fast path)
        assert opencv_pixels(data, opened) is not None


def test_a_png_opencv_cannot_decode_goes_to_pil(monkeypatch: pytest.MonkeyPatch) -> None:
    data = PLAIN_PNGS["plain rgb png"]()
    monkeypatch.setattr(read_module.cv2, "imdecode", lambda *_: None)
    pixels = decode_pixels(data, max_pixels=10**6, source="x.png")
    assert np.array_equal(pixels, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_a_ref_whose_own_hash_differs_from_the_outer_hash_is_rejected(offload_store: OffloadStore) -> None:
    stored = offload_store.put(Image.new("RGB", (4, 4), "red"))
    ref = parse_ref(encode_ref(descriptor(stored.uri), stored.mm_hash))
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(ref, mm_hash="0" * 32, roots=[offload_store.root])
    assert reason_of(excinfo) == "hash_mismatch"


def test_bytes_that_do_not_hash_to_the_ref_are_rejected(offload_store: OffloadStore) -> None:
    red = offload_store.put(Image.new("RGB", (4, 4), "red"))
    blue = offload_store.put(Image.new("RGB", (4, 4), "blue"))
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(descriptor(red.uri), mm_hash=blue.mm_hash, roots=[offload_store.root])
    assert reason_of(excinfo) == "hash_mismatch"


def test_a_root_given_through_a_symlink_confines_to_nothing(
    offload_store: OffloadStore, tmp_path: Path
) -> None:
    # Roots are resolved once by their owner (the engine's RequestImages, the trainer's materializer); an
    # unresolved one is refused, never followed.
    stored = offload_store.put(Image.new("RGB", (4, 4), "red"))
    link = tmp_path / "offload-link"
    link.symlink_to(offload_store.root, target_is_directory=True)
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(descriptor(stored.uri), mm_hash=stored.mm_hash, roots=[link])
    assert reason_of(excinfo) == "outside_offload_root"


def test_a_malformed_hash_is_a_malformed_ref(offload_store: OffloadStore) -> None:
    stored = offload_store.put(Image.new("RGB", (4, 4), "red"))
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(descriptor(stored.uri), mm_hash="XYZ", roots=[offload_store.root])
    assert reason_of(excinfo) == "malformed_ref"


def test_files_outside_the_root_are_never_read(offload_store: OffloadStore, tmp_path: Path) -> None:
    outside = tmp_path / "secret.png"
    data = png_bytes(Image.new("RGB", (4, 4), "green"))
    outside.write_bytes(data)
    mm_hash = hashlib.sha256(data).hexdigest()[:32]
    link = offload_store.root / "escape.png"
    os.symlink(outside, link)
    for uri in (f"file://{outside}", f"file://{link}", f"file://{offload_store.root}/../secret.png"):
        with pytest.raises(InvalidImageRef) as excinfo:
            read_ref_image(descriptor(uri), mm_hash=mm_hash, roots=[offload_store.root])
        assert reason_of(excinfo) == "outside_offload_root", uri


def test_missing_and_unreadable_files(offload_store: OffloadStore) -> None:
    (offload_store.root / "adir").mkdir()
    cases = {
        f"file://{offload_store.root}/ab/nothing.png": "missing_file",
        f"file://{offload_store.root}/adir": "unreadable_file",
    }
    for uri, reason in cases.items():
        with pytest.raises(InvalidImageRef) as excinfo:
            read_ref_image(descriptor(uri), mm_hash="a" * 32, roots=[offload_store.root])
        assert reason_of(excinfo) == reason


def test_bytes_that_are_not_an_image_are_a_decode_error(offload_store: OffloadStore) -> None:
    data = b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10
    path = offload_store.root / "junk.png"
    path.write_bytes(data)
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(
            descriptor(f"file://{path}"),
            mm_hash=hashlib.sha256(data).hexdigest()[:32],
            roots=[offload_store.root],
        )
    assert reason_of(excinfo) == "decode_error"


def test_a_format_outside_vllms_allow_list_is_refused_from_its_header(offload_store: OffloadStore) -> None:
    """An EPS (whose decoding would run Ghostscript on its PostScript) is refused before any decoding, as
    vLLM's own loader refuses it, with the format named."""
    from vllm.multimodal.media.image import ImageMediaIO

    data = encoded(Image.new("RGB", (4, 3), "red"), "EPS")
    path = offload_store.root / "page.png"  # the store refuses it at ingest; a rogue writer may not
    path.write_bytes(data)
    ref = descriptor(f"file://{path}")
    mm_hash = hashlib.sha256(data).hexdigest()[:32]
    refusals = (
        lambda: open_ref_image(ref, mm_hash=mm_hash, roots=[offload_store.root]),
        lambda: read_ref_image(ref, mm_hash=mm_hash, roots=[offload_store.root]),
        lambda: decode_pixels(data, max_pixels=10**6, source="page.png"),
    )
    for refuse in refusals:
        with pytest.raises(InvalidImageRef, match="EPS is not an allowed image format") as excinfo:
            refuse()
        assert reason_of(excinfo) == "decode_error"
    with pytest.raises(ValueError, match="cannot identify image file"):
        ImageMediaIO().load_bytes(data)


def test_a_truncated_image_is_a_decode_error(offload_store: OffloadStore) -> None:
    data = png_bytes(Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    truncated = data[: len(data) // 2]
    path = offload_store.root / "half.png"
    path.write_bytes(truncated)
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(
            descriptor(f"file://{path}"),
            mm_hash=hashlib.sha256(truncated).hexdigest()[:32],
            roots=[offload_store.root],
        )
    assert reason_of(excinfo) == "decode_error"


def test_a_decompression_bomb_is_refused_from_its_header(offload_store: OffloadStore) -> None:
    # A PNG header claiming 20000 x 20000 pixels (400M, past PIL's own bomb limit) in 45 bytes.
    ihdr = struct.pack(">IIBBBBB", 20_000, 20_000, 8, 2, 0, 0, 0)
    bomb = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")
    path = offload_store.root / "bomb.png"  # the store refuses bombs at ingest; a rogue writer may not
    path.write_bytes(bomb)
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(
            descriptor(f"file://{path}"),
            mm_hash=hashlib.sha256(bomb).hexdigest()[:32],
            roots=[offload_store.root],
            max_pixels=10**6,
        )
    assert reason_of(excinfo) == "image_too_large"
    # Our limit applies even below PIL's own bomb threshold.
    small = offload_store.put(Image.new("RGB", (1001, 1000)))
    with pytest.raises(InvalidImageRef) as excinfo:
        read_ref_image(
            descriptor(small.uri), mm_hash=small.mm_hash, roots=[offload_store.root], max_pixels=10**6
        )
    assert reason_of(excinfo) == "image_too_large"


def test_every_reader_refuses_files_over_the_one_size_limit(
    offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's checked read and the materializers' read are one: the same limit, the same reason."""
    from rawmm.contract import store

    stored = offload_store.put(Image.new("RGB", (4, 4), "red"))
    size = stored.path.stat().st_size
    monkeypatch.setattr(store, "MAX_IMAGE_FILE_BYTES", size)
    assert offload_store.read_verified(stored.uri, stored.mm_hash) == stored.path.read_bytes()
    read_ref_image(descriptor(stored.uri), mm_hash=stored.mm_hash, roots=[offload_store.root])
    monkeypatch.setattr(store, "MAX_IMAGE_FILE_BYTES", size - 1)
    for read in (
        lambda: offload_store.read_verified(stored.uri, stored.mm_hash),
        lambda: read_ref_image(descriptor(stored.uri), mm_hash=stored.mm_hash, roots=[offload_store.root]),
    ):
        with pytest.raises(InvalidImageRef) as excinfo:
            read()
        assert reason_of(excinfo) == "image_too_large"
