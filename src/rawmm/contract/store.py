"""The content-addressed offload store (docs/architecture.md §3.1).

``<root>/<sha[0:2]>/<sha>.<ext>``: the bytes' sha256 names the file, so equal bytes always land on one
path and one URI. Writes are atomic (``rawmm.contract.files``), so a reader never sees a partial file and
concurrent writers of the same bytes simply replace an identical file. Re-offloading existing bytes touches the file: its mtime is its last use,
which is what garbage collection goes by (``rawmm.contract.gc`` describes the protocol that keeps a reuse
racing a collection from losing its file).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import io
import os
import re
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from PIL import Image, UnidentifiedImageError

from rawmm.contract.errors import ImageIngestError, InvalidImageRef
from rawmm.contract.files import temp_target, write_atomically
from rawmm.contract.formats import DeniedImageFormat, open_allowed
from rawmm.contract.refs import check_mm_hash
from rawmm.contract.retention_bounds import REUSE_UNLOCKED_AGE_S

MM_HASH_CHARS = 32
_FILE_SCHEME = "file://"
_EXT_BY_FORMAT = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif"}
_STORED_NAME_RE = re.compile(r"([0-9a-f]{64})\.(png|jpg|webp|gif|img)")
# Encoded images this large are not screenshots; a reader refuses them before reading them into memory.
MAX_IMAGE_FILE_BYTES = 256 * 1024 * 1024
GC_LOCK_NAME = ".gc.lock"
# Linux limits: longer paths or components fail with ENAMETOOLONG, which must not reach a caller as OSError.
_PATH_MAX = 4096
_NAME_MAX = 255


@dataclass(frozen=True)
class StoredImage:
    """One image in the store. ``mm_hash`` is the first 32 hex characters of ``sha256``."""

    uri: str
    sha256: str
    path: Path
    width: int
    height: int

    @property
    def mm_hash(self) -> str:
        return self.sha256[:MM_HASH_CHARS]


def path_to_uri(path: Path) -> str:
    """``file://`` URI of an absolute path (empty netloc), percent-quoting what needs it."""
    return _FILE_SCHEME + quote(str(path))


def resolve_uri(uri: Any, roots: Sequence[Path]) -> Path:
    """The real path a ``file://`` URI names, provided it lies inside one of ``roots``.

    Symlinks are resolved before the check, so a link out of the root is as outside as ``..``.
    Raises ``InvalidImageRef``: ``outside_offload_root`` (other scheme or host, relative path, escape),
    ``malformed_ref`` (not a URI), ``missing_file`` (inside the root but absent), ``unreadable_file``.
    """
    if not isinstance(uri, str):
        raise InvalidImageRef("malformed_ref", f"image URI must be a string, got {type(uri).__name__}")
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise InvalidImageRef("malformed_ref", f"not a URI: {exc}") from None
    if parts.scheme != "file":
        raise InvalidImageRef(
            "outside_offload_root", f"only file:// URIs are read, got scheme {parts.scheme!r}"
        )
    if parts.netloc not in ("", "localhost"):
        raise InvalidImageRef("outside_offload_root", f"file URI names another host {parts.netloc!r}")
    if parts.query or parts.fragment:
        raise InvalidImageRef("malformed_ref", "file URI carries a query or fragment")
    try:
        raw_path = unquote(parts.path, errors="strict")
    except UnicodeDecodeError:
        raise InvalidImageRef("malformed_ref", "file URI path is not UTF-8") from None
    if (problem := path_problem(raw_path)) is not None:
        raise InvalidImageRef("malformed_ref", f"file URI: {problem}")
    candidate = Path(raw_path)
    if not candidate.is_absolute():
        raise InvalidImageRef("outside_offload_root", f"file URI path {raw_path[:200]!r} is not absolute")
    try:
        real = candidate.resolve()
    except (OSError, RuntimeError) as exc:
        raise InvalidImageRef("unreadable_file", f"cannot resolve {raw_path[:200]!r}: {exc}") from None
    if not any(real != root and real.is_relative_to(root) for root in roots):
        raise InvalidImageRef("outside_offload_root", f"{raw_path[:200]!r} is outside the offload root")
    try:
        mode = real.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidImageRef("missing_file", f"{raw_path[:200]!r} does not exist") from None
    except OSError as exc:
        raise InvalidImageRef("unreadable_file", f"cannot stat {raw_path[:200]!r}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise InvalidImageRef("unreadable_file", f"{raw_path[:200]!r} is not a regular file")
    return real


def path_problem(path: str) -> str | None:
    """Why no file system could hold ``path`` (the OS would raise instead of answering), or None."""
    if "\x00" in path:
        return "the path contains a NUL byte"
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a JSON "\ud800" escape
        return "the path is not valid Unicode"
    if len(encoded) >= _PATH_MAX or any(len(part) > _NAME_MAX for part in encoded.split(b"/")):
        return f"the path is longer than the file system allows ({len(encoded)} bytes)"
    return None


# EXIF orientations that turn the image a quarter (transpose, 270°, transverse, 90°): width and height swap.
_QUARTER_TURNS = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION = 0x0112


def displayed_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened image as it is displayed, i.e. after its EXIF orientation (header only).

    Decoders apply the orientation (vLLM's image loader and ours alike), so the layout of a rotated photo
    follows its displayed size, not its stored one."""
    width, height = image.size
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION)
    except Exception:  # noqa: BLE001 - a broken EXIF block is ignored, as the decoders ignore it
        orientation = None
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def _identify(data: bytes, source: str) -> tuple[str, int, int]:
    """(extension, width, height as displayed) of encoded image bytes, reading only the header."""
    try:
        with open_allowed(data) as image:
            return _EXT_BY_FORMAT.get(image.format or "", "img"), *displayed_size(image)
    except DeniedImageFormat as exc:
        raise ImageIngestError(f"{source} is not a readable image: {exc}") from None
    except UnidentifiedImageError:
        raise ImageIngestError(f"{source} is not a readable image: unknown image format") from None
    except (Image.DecompressionBombError, OSError, ValueError) as exc:
        raise ImageIngestError(f"{source} is not a readable image: {exc}") from None


def _decode_data_url(url: str) -> bytes:
    header, sep, body = url.partition(",")
    if not sep:
        raise ImageIngestError("data: URL has no ',' separator")
    media_type, *params = header[len("data:") :].split(";")
    if media_type and not media_type.startswith("image/"):
        raise ImageIngestError(f"data: URL holds {media_type!r}, not an image")
    if "base64" in params:
        try:
            return base64.b64decode(body, validate=True)
        except binascii.Error as exc:
            raise ImageIngestError(f"data: URL has invalid base64: {exc}") from None
    return unquote(body).encode("latin-1")


def stored_sha(name: str) -> str | None:
    """The sha256 a store file name (``<sha>.<ext>``) carries; None for any other name."""
    match = _STORED_NAME_RE.fullmatch(name)
    return match.group(1) if match else None


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file of a stored image (a write in progress, or a dead writer's)."""
    target = temp_target(name)
    return target is not None and stored_sha(target) is not None


def read_verified(uri: Any, mm_hash: str, roots: Sequence[Path]) -> bytes:
    """The bytes of the file a ``file://`` URI names, read only inside ``roots`` (resolved directories)
    and checked against ``mm_hash`` (a sha256 hex prefix) before anyone parses them.

    Raises ``InvalidImageRef``: ``malformed_ref`` (not a hash, not a URI), ``outside_offload_root``,
    ``missing_file``, ``unreadable_file``, ``image_too_large`` (over ``MAX_IMAGE_FILE_BYTES``),
    ``hash_mismatch``.
    """
    check_mm_hash(mm_hash)
    path = resolve_uri(uri, roots)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # Sized by the stat, not the limit: read(limit) allocates the limit (256 MiB mapped and unmapped
            # under the GIL on every read, 7x the read itself). Bounded by the read too: the file may grow
            # in between.
            data = handle.read(size + 1) if size <= MAX_IMAGE_FILE_BYTES else b""
            if len(data) > size:
                data += handle.read(MAX_IMAGE_FILE_BYTES + 1 - len(data))
    except FileNotFoundError:
        raise InvalidImageRef("missing_file", f"{path} vanished before it was read") from None
    except OSError as exc:
        raise InvalidImageRef("unreadable_file", f"cannot read {path}: {exc.strerror or exc}") from None
    if max(size, len(data)) > MAX_IMAGE_FILE_BYTES:
        raise InvalidImageRef(
            "image_too_large", f"{path} is {max(size, len(data))} bytes or more, over {MAX_IMAGE_FILE_BYTES}"
        )
    if not hashlib.sha256(data).hexdigest().startswith(mm_hash):
        raise InvalidImageRef("hash_mismatch", f"bytes at {uri} do not hash to {mm_hash}")
    return data


@contextlib.contextmanager
def directory_lock(directory: str | Path, *, exclusive: bool) -> Iterator[None]:
    """Hold a fan-out directory's GC lock: exclusive for a collection, shared for a writer reusing an old file.

    ``flock`` is released by the kernel when its holder dies, so a killed collector or writer never leaves
    the directory locked. On NFS Linux emulates it with whole-file byte-range locks, which the server
    arbitrates across clients; an exclusive one needs the file open for writing.
    """
    path = f"{directory}/{GC_LOCK_NAME}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file: a shared lock needs only read access
        if exclusive:
            raise
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _touch(path: str | Path) -> bool:
    """Mark a stored file as just used; False if it does not exist or its mtime cannot be set (another
    user's file on a shared volume): the caller then writes a fresh copy, whose mtime records this use."""
    try:
        os.utime(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def _reuse(directory: str, path: str) -> bool:
    """Touch an existing stored file as reused; False if the caller must write it (absent or untouchable).

    A file unused for REUSE_UNLOCKED_AGE_S may be in a collector's hands, so it is touched under the
    directory's shared lock: the touch lands wholly before the collector's last look (which then keeps it)
    or wholly after its unlink (the touch fails and the caller writes the file again).
    """
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if time.time() - mtime < REUSE_UNLOCKED_AGE_S:
        return _touch(path)
    with directory_lock(directory, exclusive=False):
        return _touch(path)


class OffloadStore:
    """A content-addressed image directory shared by every process of a run."""

    def __init__(self, root: str | Path) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(root).resolve()
        self._root_str = str(self.root)

    def put(self, image: Any, media_type: str | None = None) -> StoredImage:
        """Offload ``image``: bytes, a PIL image, a ``data:`` URL, a local path or a ``file://`` URI under the root.

        ``media_type`` is the caller's declared type; it must be an image type, but the file extension
        always follows the bytes' real format, so equal bytes share one path whatever was declared.
        """
        if media_type is not None and not media_type.startswith("image/"):
            raise ImageIngestError(f"media type {media_type!r} is not an image type")
        if isinstance(image, bytes | bytearray | memoryview):
            return self._put_bytes(bytes(image), "image bytes")
        if isinstance(image, Image.Image):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            return self._put_bytes(buffer.getvalue(), "PIL image")
        if isinstance(image, Path):
            return self._put_file(image)
        if isinstance(image, str):
            if image.startswith("data:"):
                return self._put_bytes(_decode_data_url(image), "data: URL")
            if image.startswith("file://"):
                return self._put_existing(image)
            if "://" in image:
                raise ImageIngestError(
                    f"cannot ingest {image[:80]!r}: only data:, file:// and local paths are supported"
                )
            return self._put_file(Path(image))
        raise ImageIngestError(f"cannot ingest an image given as {type(image).__name__}")

    def resolve(self, uri: str) -> Path:
        """The path of a ``file://`` URI inside this store's root (see ``resolve_uri``)."""
        return resolve_uri(uri, (self.root,))

    def read_verified(self, uri: str, mm_hash: str) -> bytes:
        """The bytes at ``uri`` inside this store, checked against ``mm_hash`` (see ``read_verified``)."""
        return read_verified(uri, mm_hash, (self.root,))

    def _put_file(self, path: Path) -> StoredImage:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ImageIngestError(
                f"cannot read image file {str(path)[:200]!r}: {exc.strerror or exc}"
            ) from None
        return self._put_bytes(data, str(path))

    def _put_existing(self, uri: str) -> StoredImage:
        path = self.resolve(uri)
        match = _STORED_NAME_RE.fullmatch(path.name)
        if match is None or path.parent.parent != self.root or path.parent.name != match.group(1)[:2]:
            # A file under the root that the store did not name: ingest its bytes properly.
            return self._put_file(path)
        if not _reuse(str(path.parent), str(path)):
            # Collected since it was resolved, or another user's file: write it anew from its bytes.
            return self._put_file(path)
        try:
            with open_allowed(path) as image:
                width, height = displayed_size(image)
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as exc:
            raise ImageIngestError(f"stored file {path} is not a readable image: {exc}") from None
        return StoredImage(
            uri=path_to_uri(path), sha256=match.group(1), path=path, width=width, height=height
        )

    def _put_bytes(self, data: bytes, source: str) -> StoredImage:
        ext, width, height = _identify(data, source)
        sha = hashlib.sha256(data).hexdigest()
        # Plain strings on this path: it runs once per image of every rollout turn.
        directory = f"{self._root_str}/{sha[:2]}"
        path = f"{directory}/{sha}.{ext}"
        if not _reuse(directory, path):
            write_atomically(path, data)
        return StoredImage(
            uri=_FILE_SCHEME + quote(path), sha256=sha, path=Path(path), width=width, height=height
        )
