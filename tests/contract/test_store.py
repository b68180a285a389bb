import base64
import hashlib
import io
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from rawmm.contract import ImageIngestError, InvalidImageRef, OffloadStore, StoredImage
from rawmm.contract.store import path_to_uri


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def noise_png(seed: int, size: tuple[int, int] = (37, 21)) -> bytes:
    return encode(
        Image.frombytes(
            "RGB", size, hashlib.sha256(str(seed).encode()).digest() * (size[0] * size[1] // 10 + 1)
        )
    )


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("fmt", "ext"), [("PNG", "png"), ("JPEG", "jpg"), ("WEBP", "webp"), ("GIF", "gif"), ("BMP", "img")]
)
def test_content_addressed_layout(offload_store: OffloadStore, fmt: str, ext: str) -> None:
    data = encode(Image.new("RGB", (7, 5), "teal"), fmt)
    stored = offload_store.put(data)
    sha = hashlib.sha256(data).hexdigest()
    assert stored.path == offload_store.root / sha[:2] / f"{sha}.{ext}"
    assert stored.uri == f"file://{stored.path}"
    assert (stored.sha256, stored.mm_hash, stored.width, stored.height) == (sha, sha[:32], 7, 5)
    assert stored.path.read_bytes() == data
    assert files_under(offload_store.root) == [stored.path]


def test_every_source_of_the_same_bytes_lands_on_one_file(
    offload_store: OffloadStore, tmp_path: Path
) -> None:
    data = noise_png(1)
    local = tmp_path / "shot.bin"  # the suffix must not matter
    local.write_bytes(data)
    results = [
        offload_store.put(data),
        offload_store.put(bytearray(data), media_type="image/jpeg"),  # a wrong declared type changes nothing
        offload_store.put("data:image/png;base64," + base64.b64encode(data).decode()),
        offload_store.put(str(local)),
        offload_store.put(local),
    ]
    results.append(offload_store.put(results[0].uri))
    assert len({(r.uri, r.sha256) for r in results}) == 1
    assert len(files_under(offload_store.root)) == 1


def test_pil_images_are_stored_losslessly(offload_store: OffloadStore) -> None:
    image = Image.frombytes("RGB", (4, 3), bytes(range(36)))
    stored = offload_store.put(image)
    assert stored.path.suffix == ".png"
    with Image.open(stored.path) as reread:
        assert reread.tobytes() == image.tobytes()


def test_file_uri_under_root_with_a_foreign_name_is_reingested(offload_store: OffloadStore) -> None:
    foreign = offload_store.root / "manual.png"
    foreign.write_bytes(noise_png(2))
    stored = offload_store.put(path_to_uri(foreign))
    assert stored.path.name == f"{stored.sha256}.png" and stored.path != foreign


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (b"definitely not an image", "not a readable image"),
        ("https://example.com/x.png", "only data:, file:// and local paths"),
        ("data:text/plain;base64,aGk=", "not an image"),
        ("data:image/png;base64,***", "invalid base64"),
        ("/nonexistent/x.png", "cannot read image file"),
        (12, "given as int"),
    ],
)
def test_bad_sources_are_clear_errors_and_store_nothing(
    offload_store: OffloadStore, source: object, match: str
) -> None:
    with pytest.raises(ImageIngestError, match=match):
        offload_store.put(source)
    assert files_under(offload_store.root) == []


def test_non_image_media_type_is_rejected(offload_store: OffloadStore) -> None:
    with pytest.raises(ImageIngestError, match="not an image type"):
        offload_store.put(noise_png(3), media_type="text/html")


def test_reuse_touches_the_file(offload_store: OffloadStore) -> None:
    stored = offload_store.put(noise_png(4))
    os.utime(stored.path, (1_000_000, 1_000_000))
    again = offload_store.put(noise_png(4))
    assert again == stored
    assert stored.path.stat().st_mtime > 1_000_000
    os.utime(stored.path, (1_000_000, 1_000_000))
    offload_store.put(stored.uri)
    assert stored.path.stat().st_mtime > 1_000_000


def test_failed_write_leaves_nothing_behind(
    offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        offload_store.put(noise_png(5))
    assert files_under(offload_store.root) == []
    monkeypatch.undo()
    assert offload_store.put(noise_png(5)).path.read_bytes() == noise_png(5)


def test_concurrent_thread_writers_of_the_same_bytes(offload_store: OffloadStore) -> None:
    data = noise_png(6, (300, 200))
    barrier = threading.Barrier(16)

    def writer(_: int) -> StoredImage:
        barrier.wait(timeout=30)
        return offload_store.put(data)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(writer, range(16)))
    assert len(set(results)) == 1
    assert files_under(offload_store.root) == [results[0].path]
    assert results[0].path.read_bytes() == data


def _process_writer(root: str, data: bytes, barrier: Any, queue: Any) -> None:
    barrier.wait(timeout=30)
    store = OffloadStore(root)
    queue.put([store.put(data).uri for _ in range(20)])


def test_concurrent_process_writers_of_the_same_bytes(offload_store: OffloadStore) -> None:
    data = noise_png(7, (300, 200))
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(4), context.Queue()
    workers = [
        context.Process(target=_process_writer, args=(str(offload_store.root), data, barrier, queue))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    try:
        uris = {uri for _ in workers for uri in queue.get(timeout=60)}
    finally:
        for worker in workers:
            worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert len(uris) == 1
    (only,) = files_under(offload_store.root)
    assert only.read_bytes() == data


# --- confinement ----------------------------------------------------------------------------------


@pytest.fixture
def stored(offload_store: OffloadStore) -> StoredImage:
    return offload_store.put(noise_png(8))


def test_resolve_and_read_verified_accept_stored_images(
    offload_store: OffloadStore, stored: StoredImage
) -> None:
    assert offload_store.resolve(stored.uri) == stored.path
    assert offload_store.resolve(stored.uri.replace("file://", "file://localhost")) == stored.path
    assert offload_store.read_verified(stored.uri, stored.mm_hash) == stored.path.read_bytes()
    assert offload_store.read_verified(stored.uri, stored.sha256) == stored.path.read_bytes()


def test_outside_root_cases(offload_store: OffloadStore, stored: StoredImage, tmp_path: Path) -> None:
    outside = tmp_path / "secret.png"
    outside.write_bytes(noise_png(9))
    sibling = tmp_path / "offload-evil"  # shares the root's name as a string prefix
    sibling.mkdir()
    (sibling / "x.png").write_bytes(noise_png(9))
    escape_link = offload_store.root / "ab" / "link.png"
    escape_link.parent.mkdir(exist_ok=True)
    escape_link.symlink_to(outside)
    root = offload_store.root
    cases = [
        f"file://{root}/../secret.png",
        f"file://{root}/%2e%2e/secret.png",
        f"file://{escape_link}",
        f"file://{sibling}/x.png",
        f"file://otherhost{stored.path}",
        f"http://localhost{stored.path}",
        f"s3://bucket{stored.path}",
        "data:image/png;base64,AAAA",
        f"{stored.path}",
        "file:relative/x.png",
        f"file://{root}",
    ]
    for uri in cases:
        with pytest.raises(InvalidImageRef) as info:
            offload_store.resolve(uri)
        assert info.value.reason == "outside_offload_root", uri


def test_symlinks_inside_the_root_are_followed(offload_store: OffloadStore, stored: StoredImage) -> None:
    link = offload_store.root / "alias.png"
    link.symlink_to(stored.path)
    assert offload_store.resolve(path_to_uri(link)) == stored.path


@pytest.mark.parametrize(
    ("suffix", "reason"),
    [("/ab/missing.png", "missing_file"), ("/ab", "unreadable_file"), ("/x.png?v=1", "malformed_ref")],
)
def test_other_resolve_failures(
    offload_store: OffloadStore, stored: StoredImage, suffix: str, reason: str
) -> None:
    (offload_store.root / "ab").mkdir(exist_ok=True)
    with pytest.raises(InvalidImageRef) as info:
        offload_store.resolve(f"file://{offload_store.root}{suffix}")
    assert info.value.reason == reason


def test_read_verified_detects_changed_bytes_and_bad_hashes(
    offload_store: OffloadStore, stored: StoredImage
) -> None:
    other = noise_png(10)
    with pytest.raises(InvalidImageRef) as info:
        offload_store.read_verified(stored.uri, hashlib.sha256(other).hexdigest()[:32])
    assert info.value.reason == "hash_mismatch"
    stored.path.write_bytes(other)
    with pytest.raises(InvalidImageRef) as info:
        offload_store.read_verified(stored.uri, stored.mm_hash)
    assert info.value.reason == "hash_mismatch"
    with pytest.raises(InvalidImageRef) as info:
        offload_store.read_verified(stored.uri, "not-hex")
    assert info.value.reason == "malformed_ref"


def test_read_verified_allocates_the_file_not_the_size_limit(
    offload_store: OffloadStore, stored: StoredImage
) -> None:
    """A read sized by the limit (256 MiB) maps and unmaps that much on every read, under the GIL."""
    import tracemalloc

    tracemalloc.start()
    try:
        offload_store.read_verified(stored.uri, stored.mm_hash)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * stored.path.stat().st_size + 2**20


def test_read_verified_bounds_a_file_that_grew_after_its_stat(
    offload_store: OffloadStore, stored: StoredImage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stat said less than the read finds (the file grew in between): the read goes on to the limit and no
    further, so the limit holds, and bytes within it are whole (then the hash decides)."""
    from rawmm.contract import store

    real_size = stored.path.stat().st_size
    real_fstat = os.fstat

    def stale_fstat(fd: int) -> os.stat_result:
        fields = list(real_fstat(fd))
        fields[6] = real_size // 2  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(store.os, "fstat", stale_fstat)
    assert offload_store.read_verified(stored.uri, stored.mm_hash) == stored.path.read_bytes()
    monkeypatch.setattr(store, "MAX_IMAGE_FILE_BYTES", real_size - 1)
    with pytest.raises(InvalidImageRef) as info:
        offload_store.read_verified(stored.uri, stored.mm_hash)
    assert info.value.reason == "image_too_large"


@pytest.mark.parametrize(
    "tail",
    [
        "\ud800.png",  # a lone surrogate (a JSON ref's "\ud800" escape): not encodable as a path
        "%ED%A0%80.png",  # the same surrogate percent-encoded: not UTF-8
        "ab/" + "a" * 300 + ".png",  # one component over NAME_MAX
        "ab/" * 1500 + "x.png",  # the whole path over PATH_MAX
    ],
)
def test_unusable_paths_are_malformed_refs(offload_store: OffloadStore, tail: str) -> None:
    with pytest.raises(InvalidImageRef) as info:
        offload_store.resolve(f"file://{offload_store.root}/{tail}")
    assert info.value.reason == "malformed_ref"
