"""GC passes running flat out while images are re-offloaded and batches are trained: nothing referenced goes missing.

Three threads share one store: an ingest thread that keeps reusing images a while unused (it makes each
one collectable, re-offloads it and reads the ref back as an engine would), a trainer that materializes
each pending batch with the run's materializer and then checkpoints it, and GC passes back to back.
"""

from __future__ import annotations

import contextlib
import random
import threading

import pytest
from retention_kit import HOUR, age, aged_images, checkpoint, png, write_step

from rawmm.contract import InvalidImageRef, OffloadStore
from rawmm.contract.shared_dir import SharedDir
from rawmm.materialize import LoadedProcessor
from rawmm.rl.batches import read_batch
from rawmm.rl.retention.watch import run_pass
from rawmm.rl.trainer.materializer import RawImageMaterializer
from rawmm.rl.trainer.packing import pack_samples

REUSES = 400
STEPS = range(4, 8)


@pytest.mark.timeout(120)
def test_gc_under_concurrent_ingest_and_training_loses_no_referenced_image(
    shared: SharedDir, store: OffloadStore, loaded: LoadedProcessor
) -> None:
    trained = aged_images(store, range(0, 30))  # batches 1..3, already trained
    pending = aged_images(store, range(30, 60))  # batches 4..7, not yet trained
    reused = aged_images(store, range(60, 160))  # no batch: only the ingest thread keeps them alive
    for i, step in enumerate(range(1, 4)):
        write_step(shared, step, trained[10 * i : 10 * i + 10], loaded)
    for i, step in enumerate(STEPS):
        write_step(shared, step, pending[i::4], loaded)
    checkpoint(shared, 3)

    done = threading.Event()
    failures: list[str] = []
    missing_in_training: list[int] = []
    passes = []

    def ingest() -> None:
        rng = random.Random(0)
        for n in range(REUSES):
            seed = rng.randrange(60, 160)
            with contextlib.suppress(FileNotFoundError):  # collected already: the put writes it anew
                age(reused[seed - 60].path, 2 * HOUR)
            stored = store.put(png(seed))  # the reuse of an image unused for two hours
            try:
                store.read_verified(stored.uri, stored.mm_hash)  # the ref ships: an engine reads it
            except InvalidImageRef as exc:
                failures.append(f"reuse {n}: {exc.reason}: {exc}")

    def train() -> None:
        materializer = RawImageMaterializer(loaded, roots=[store.root], missing_image_policy="zero_loss")
        for step in STEPS:
            materializer.begin_step(step)
            for micro_batch in pack_samples(read_batch(shared.rollouts_dir, step).samples, 4096):
                materializer.materialize(micro_batch)
            missing_in_training.append(materializer.stats.missing)
            checkpoint(shared, step)

    def collect() -> None:
        while not done.is_set():
            passes.append(run_pass(store.root, shared.path, older_than=HOUR))

    def recording(work):  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                work()
            except Exception as exc:  # a thread's exception fails the test, not just a warning
                failures.append(f"{work.__name__}: {type(exc).__name__}: {exc}")

        return run

    threads = [threading.Thread(target=recording(f)) for f in (ingest, train)]
    collector = threading.Thread(target=recording(collect))
    collector.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    done.set()
    collector.join(timeout=20)

    assert failures == []
    assert missing_in_training == [0] * len(STEPS)  # the trainer's missing-image counter stays 0
    assert len(passes) > 1 and sum(p.report.removed_files for p in passes) > 0
    final = run_pass(store.root, shared.path, older_than=HOUR)  # everything trained: all old images may go
    assert all(not s.path.exists() for s in trained + pending)
    assert final.report.remaining_files == sum(1 for s in reused if s.path.exists())
