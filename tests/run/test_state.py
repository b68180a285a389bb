"""What a local run's summary says about its shared directory."""

from __future__ import annotations

from pathlib import Path

from rawmm.contract.shared_dir import SharedDir, checkpoint_dir, latest_path, staging_dir
from rawmm.run.state import RunState


def test_the_summary_lists_the_finished_checkpoints_in_step_order(tmp_path: Path) -> None:
    shared = SharedDir(tmp_path / "shared")
    for step in (10, 2, 1):
        checkpoint_dir(shared.checkpoints_dir, step).mkdir(parents=True)
    staging_dir(shared.checkpoints_dir, 11).mkdir()  # still being written
    latest_path(shared.checkpoints_dir).write_text("10\n")
    summary = RunState(engine_urls=[]).summary(
        status="completed",
        error=None,
        steps=10,
        shared_dir=shared.path,
        output_dir=tmp_path,
        wall_seconds=1.0,
    )
    assert summary["checkpoints"] == [str(checkpoint_dir(shared.checkpoints_dir, s)) for s in (1, 2, 10)]
