"""The one atomic write (stored images, rollout batches, `latest`) and the temporary names GC goes by."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from retention_kit import age, png

from rawmm.contract import OffloadStore
from rawmm.contract.files import temp_target, write_atomically
from rawmm.contract.gc import STALE_TEMP_AGE_S, collect
from rawmm.contract.store import is_temp_name


def test_a_write_replaces_the_file_whole_and_leaves_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "new-dir" / "latest"  # the directory is created on the first write
    write_atomically(path, b"1\n")
    write_atomically(path, b"2\n")
    assert path.read_bytes() == b"2\n"
    assert os.listdir(path.parent) == ["latest"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step_1.msgpack"
    write_atomically(path, b"old")

    def replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        write_atomically(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["step_1.msgpack"]


def test_temporary_names_carry_their_final_name() -> None:
    sha = "ab" * 32
    assert temp_target(f".{sha}.png.{'0' * 16}.tmp") == f"{sha}.png"
    assert temp_target(".step_3.msgpack.0123456789abcdef.tmp") == "step_3.msgpack"
    for other in (f"{sha}.png", f".{sha}.png.tmp", f".{sha}.png.{'g' * 16}.tmp", ".gc.lock"):
        assert temp_target(other) is None
    assert is_temp_name(f".{sha}.png.{'0' * 16}.tmp")
    assert not is_temp_name(".step_3.msgpack.0123456789abcdef.tmp")  # not a stored image's: GC leaves it


def _killed_writer(path: Path, data: bytes) -> None:
    """Run `write_atomically` in a process that dies (no cleanup) between writing and renaming."""
    script = textwrap.dedent(
        f"""
        import os
        from rawmm.contract import files
        files.os.replace = lambda src, dst: os._exit(9)
        files.write_atomically({str(path)!r}, {data!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == 9, result.stderr.decode()


def test_gc_sweeps_what_a_killed_writer_left_once_it_is_stale(offload_store: OffloadStore) -> None:
    stored = offload_store.put(png(1))
    data = png(2)
    sha = hashlib.sha256(data).hexdigest()
    target = offload_store.root / sha[:2] / f"{sha}.png"  # where the store would publish it
    _killed_writer(target, data)
    (left,) = list(target.parent.iterdir())  # its temporary file, under the name it chose
    assert not target.exists() and left.read_bytes() == data

    young = collect(offload_store.root, older_than=3600.0)
    assert young.temps_removed == 0 and left.exists()  # it may be a live write: kept
    age(left, STALE_TEMP_AGE_S + 60)
    report = collect(offload_store.root, older_than=3600.0)
    assert (report.temps_removed, report.temp_bytes) == (1, len(data))
    assert not left.exists() and stored.path.exists()
