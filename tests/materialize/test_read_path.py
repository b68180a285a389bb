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
from rawmm.materialize.read import read_ref_image


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
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels), "JPEG", exif=exif.tobytes(), quality=95)


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


@pytest.mark.parametrize(
    "name", [*transparent_images(), "exif orientation 6", "exif orientation 3", "exif orientation 8"]
)
def test_the_read_image_is_what_vllms_own_loader_makes_of_the_bytes(
    name: str, offload_store: OffloadStore
) -> None:
    """Raw refs must reach the model as data URLs of the same bytes do on vLLM: the same orientation, and
    transparency over white (not the colours under it); the stored size (hence the layout) is the displayed one."""
    from vllm.multimodal.media.image import ImageMediaIO

    data = transparent_images()[name] if name in transparent_images() else rotated_jpeg(int(name[-1]))
    stored = offload_store.put(data)
    ours = read_ref_image(descriptor(stored.uri), mm_hash=stored.mm_hash, roots=[offload_store.root])
    theirs = ImageMediaIO().load_bytes(data).media
    assert ours.mode == theirs.mode == "RGB"
    assert ours.size == theirs.size == (stored.width, stored.height)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    if name == "exif orientation 6":
        assert (stored.width, stored.height) == (5, 7)
    if name == "rgba":
        assert not np.array_equal(np.asarray(ours), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


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
