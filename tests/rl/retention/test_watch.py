"""GC passes of a run: one at start, one per new checkpoint, until the run's last step."""

from __future__ import annotations

import threading

from retention_kit import HOUR, aged_images, checkpoint, poll, write_step

from rawmm.contract import OffloadStore
from rawmm.contract.shared_dir import SharedDir
from rawmm.materialize import LoadedProcessor
from rawmm.rl.retention.watch import PassResult, watch


def test_a_pass_per_checkpoint_frees_each_trained_steps_images_and_stops_after_the_last(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor
) -> None:
    first, second, loose = aged_images(store, range(3))
    write_step(shared, 1, [first], loaded)
    write_step(shared, 2, [second], loaded)
    passes: list[PassResult] = []
    errors: list[Exception] = []
    thread = threading.Thread(
        target=watch,
        args=(shared.offload_dir, shared.path),
        kwargs=dict(
            older_than=HOUR,
            keep_steps=0,
            final_step=2,
            on_pass=passes.append,
            on_error=errors.append,
            poll_s=0.01,
        ),
    )
    thread.start()
    poll(lambda: len(passes) == 1, "the first pass")
    assert not loose.path.exists() and first.path.exists() and second.path.exists()

    (shared.rollouts_dir / "step_2.msgpack").rename(shared.rollouts_dir / "step_2.bak")
    (shared.rollouts_dir / "step_2.msgpack").write_bytes(b"torn")  # a batch this pass cannot read
    checkpoint(shared, 1)
    poll(lambda: len(errors) == 1, "the failed pass to be reported")
    assert first.path.exists() and second.path.exists()  # nothing removed on a partial view

    (shared.rollouts_dir / "step_2.bak").replace(shared.rollouts_dir / "step_2.msgpack")
    checkpoint(shared, 2)
    thread.join(timeout=20)
    assert not thread.is_alive()  # the last step's pass ends the watch
    assert not first.path.exists() and not second.path.exists()
    assert [p.needed.latest_step for p in passes if p.needed] == [0, 2]
    assert [p.report.removed_files for p in passes] == [1, 2]
