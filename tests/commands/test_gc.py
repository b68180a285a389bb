"""`rawmm gc`: one pass from the command line, its dry run and errors, a kill mid-pass, and the watch mode."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ports import free_port
from retention_kit import aged_images, blocked_on, checkpoint, poll, write_step

from rawmm.cli import main
from rawmm.config import RunConfig
from rawmm.contract import OffloadStore, StoredImage
from rawmm.contract.shared_dir import SharedDir
from rawmm.contract.store import GC_LOCK_NAME, directory_lock, stored_sha
from rawmm.materialize import LoadedProcessor


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*") if stored_sha(p.name)]


def test_a_pass_keeps_what_batches_not_yet_trained_need_and_reports_what_it_freed(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor, capsys: pytest.CaptureFixture[str]
) -> None:
    trained, pending, loose = (
        aged_images(store, range(0, 2)),
        aged_images(store, range(2, 4)),
        aged_images(store, range(4, 7)),
    )
    write_step(shared, 1, trained, loaded)
    write_step(shared, 2, pending, loaded)
    checkpoint(shared, 1)

    code = main(
        ["gc", "--offload-root", str(store.root), "--shared-dir", str(shared.path), "--older-than", "1h"]
    )

    assert code == 0
    assert all(s.path.exists() for s in pending)
    assert not any(s.path.exists() for s in trained + loose)
    out = capsys.readouterr().out
    assert "removed 5 images" in out and "2 kept for batches not yet trained" in out and "2 images" in out


def test_keep_steps_also_keeps_the_last_trained_steps(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor
) -> None:
    trained = aged_images(store, range(0, 2))
    write_step(shared, 1, trained, loaded)
    checkpoint(shared, 1)
    argv = ["gc", "--offload-root", str(store.root), "--shared-dir", str(shared.path), "--older-than", "1h"]
    assert main([*argv, "--keep-steps", "1"]) == 0
    assert all(s.path.exists() for s in trained)
    assert main(argv) == 0
    assert not any(s.path.exists() for s in trained)


def test_a_dry_run_lists_what_a_pass_would_remove_and_changes_nothing(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor, capsys: pytest.CaptureFixture[str]
) -> None:
    images = aged_images(store, range(5))
    write_step(shared, 1, images[:1], loaded)
    before = snapshot(shared.path)
    argv = ["gc", "--offload-root", str(store.root), "--shared-dir", str(shared.path), "--older-than", "1h"]

    assert main([*argv, "--dry-run"]) == 0

    assert snapshot(shared.path) == before
    listed = sorted(line.removeprefix("would remove ") for line in capsys.readouterr().out.splitlines()[:-1])
    assert listed == sorted(str(s.path) for s in images[1:])
    assert main(argv) == 0
    assert sorted(str(s.path) for s in images if not s.path.exists()) == listed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "1m"], "--older-than: older-than must be at least 600s"),
        (["--older-than", "soon"], "--older-than: invalid duration 'soon'"),
        (["--keep-steps", "-1"], "--keep-steps:"),
        (["--watch"], "--watch needs --config"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    store: OffloadStore, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gc", "--offload-root", str(store.root), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_unreadable_batch_removes_nothing(
    shared: SharedDir, store: OffloadStore, capsys: pytest.CaptureFixture[str]
) -> None:
    aged_images(store, range(3))
    shared.rollouts_dir.mkdir(parents=True)
    (shared.rollouts_dir / "step_1.msgpack").write_bytes(b"torn")
    before = snapshot(store.root)
    code = main(
        ["gc", "--offload-root", str(store.root), "--shared-dir", str(shared.path), "--older-than", "1h"]
    )
    assert code == 2
    assert "nothing removed" in capsys.readouterr().err
    assert snapshot(store.root) == before


def _rawmm(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from rawmm.cli import main; sys.exit(main())", *args]


def test_a_pass_killed_midway_leaves_a_consistent_store_and_the_next_pass_finishes(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor
) -> None:
    images = aged_images(store, range(400))
    needed = images[::10]
    write_step(shared, 1, needed, loaded)
    directories = sorted({s.path.parent for s in images})
    middle = directories[len(directories) // 2]
    argv = _rawmm(
        "gc", "--offload-root", str(store.root), "--shared-dir", str(shared.path), "--older-than", "1h"
    )

    # A writer holds the middle directory's lock: the pass stops there, half done, and is killed.
    with directory_lock(middle, exclusive=False):
        process = subprocess.Popen(
            argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            poll(
                lambda: blocked_on(middle / GC_LOCK_NAME) or process.poll() is not None,
                "the pass to reach it",
                deadline_s=60.0,
            )
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)
    assert process.returncode == -signal.SIGKILL

    def collectable(s: StoredImage) -> bool:
        return s not in needed

    before, after = (
        [s for s in images if s.path.parent < middle],
        [s for s in images if s.path.parent > middle],
    )
    assert not any(s.path.exists() for s in before if collectable(s))  # the pass got this far ...
    assert all(s.path.exists() for s in after)  # ... and no further
    for path in stored_files(store.root):  # what is left is whole: every file hashes to its name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == stored_sha(path.name)
    assert all(s.path.exists() for s in needed)
    assert not [p for p in store.root.rglob(".*.tmp")]
    assert store.put(images[-1].path.read_bytes()).path == images[-1].path  # no lock left behind

    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(stored_files(store.root)) == sorted({s.path for s in needed} | {images[-1].path})


def _event(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    if not line:  # it exited: say why
        raise AssertionError(f"rawmm gc --watch exited {process.wait()}: {process.stderr.read()}")
    return json.loads(line)


def test_watch_serves_the_volume_usage_and_ends_after_the_last_step(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor, tmp_path: Path
) -> None:
    trained, loose = aged_images(store, range(0, 3)), aged_images(store, range(3, 5))
    write_step(shared, 1, trained, loaded)
    port = free_port()
    config = RunConfig.from_mapping(
        {
            "model": {"path": "unused", "preset": "qwen2_vl"},
            "shared_dir": str(shared.path),
            "trainer": {"steps": 1},
            "offload": {"retention": {"enabled": True, "older_than": "1h", "metrics_port": port}},
        }
    )
    config_path = tmp_path / "run.yaml"
    config.to_yaml(config_path)
    process = subprocess.Popen(
        _rawmm("gc", "--config", str(config_path), "--watch", "--metrics-host", "127.0.0.1"),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = _event(process)
        assert (first["event"], first["removed_files"], first["latest_step"]) == ("gc", 2, 0)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("rawmm_offload")
        }
        assert values["rawmm_offload_files"] == 3
        assert values["rawmm_offload_bytes"] == sum(s.path.stat().st_size for s in trained)
        assert values["rawmm_offload_gc_freed_bytes_total"] == first["freed_bytes"] > 0
        assert values["rawmm_offload_gc_removed_files_total"] == 2
        assert (
            0
            < values["rawmm_offload_volume_available_bytes"]
            <= values["rawmm_offload_volume_capacity_bytes"]
        )
        assert values["rawmm_offload_gc_last_run_timestamp_seconds"] > 0

        checkpoint(shared, 1)  # the last step: one more pass, then the watch ends
        last = _event(process)
        assert (last["removed_files"], last["latest_step"], last["remaining_files"]) == (3, 1, 0)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert not any(s.path.exists() for s in trained + loose)
