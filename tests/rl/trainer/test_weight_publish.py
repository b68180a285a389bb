"""Every trainer rank takes rank 0's view: its delivery of a step (`agreed_delivery`), so that all of them
write its checkpoint, or none (the checkpoint's gather and barrier take every rank); and the replicas'
`weights_step` a restarted trainer holds its replayed steps up to."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rawmm.rl.trainer.distributed import DistContext
from rawmm.rl.trainer.weight_publish import Published, WeightPublisher

# What each rank reports after `send` (under DDP only rank 0 knows; under FSDP a failed send is rank 0's alone).
CASES = (("broadcast", "reload"), ("reload", "broadcast"), ("broadcast", "broadcast"), ("reload", "reload"))


def _rank(rank: int, store_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        context = DistContext(rank=rank, world_size=2, device=torch.device("cpu"))
        publisher = WeightPublisher(
            torch.nn.Linear(2, 2),
            ["http://127.0.0.1:9"],
            context,
            sharded=False,
            # rank 0 sees the replicas at step 3 (a restarted trainer); rank 1 reads no file at all
            weights_step_path=Path(out_dir) / f"weights_step{rank}",
        )
        agreed = [publisher.agreed_delivery(Published(case[rank], 0.0, {})) for case in CASES]  # type: ignore[arg-type]
        (Path(out_dir) / f"rank{rank}").write_text(",".join(agreed))
        (Path(out_dir) / f"held{rank}").write_text(f"{publisher.held_through} {publisher.send(3).delivery}")
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_0s_delivery_and_weights_step(tmp_path: Path) -> None:
    (tmp_path / "weights_step0").write_text("3\n")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    expected = ",".join(rank_0 for rank_0, _ in CASES)
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == expected
    # a step up to rank 0's weights_step is held on every rank: none sends, none waits for the others
    assert (tmp_path / "held0").read_text() == (tmp_path / "held1").read_text() == "3 held"
