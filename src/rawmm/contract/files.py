"""The one atomic write for files on a run's shared volume: stored images, rollout batches, `latest`.

A file is published whole or not at all: its bytes go to a temporary file next to the final name
(``.<name>.<16 hex>.tmp``), are fsynced, and the temporary file is renamed over the final name. A reader
on any pod sees the old file or the new one, never a partial one, also after a crash of this host (or of
an NFS server before its COMMIT): without the fsync the name could be published on an empty file, and a
content-addressed name is never rewritten once it exists. The directory is not fsynced: a rename lost in
a crash loses only the name, which the writer's next write recreates. A temporary file left by a killed
writer carries its final name (``temp_target``), so the offload store's GC recognises and sweeps it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from typing import BinaryIO

_TEMP_NAME_RE = re.compile(r"\.(.+)\.[0-9a-f]{16}\.tmp")


def temp_target(name: str) -> str | None:
    """The file name a temporary file of ``write_atomically`` was to become; None for any other name."""
    match = _TEMP_NAME_RE.fullmatch(name)
    return match.group(1) if match else None


def _open_new(tmp: str, directory: str) -> BinaryIO:
    try:
        return open(tmp, "xb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:  # the first file of this directory (an offload fan-out directory)
        os.makedirs(directory, exist_ok=True)
        return open(tmp, "xb")  # noqa: SIM115


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Publish ``data`` at ``path`` whole or not at all (creating its directory if need be)."""
    directory, name = os.path.split(os.fspath(path))
    directory = directory or "."
    tmp = f"{directory}/.{name}.{secrets.token_hex(8)}.tmp"
    try:
        with _open_new(tmp, directory) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
