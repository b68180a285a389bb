"""`WeightPublisher.agreed_delivery`: every trainer rank learns rank 0's delivery of a step, so that all of
them write its checkpoint, or none (the checkpoint's gather and barrier take every rank)."""

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
            weights_step_path=Path(out_dir) / "w",
        )
        agreed = [publisher.agreed_delivery(Published(case[rank], 0.0, {})) for case in CASES]  # type: ignore[arg-type]
        (Path(out_dir) / f"rank{rank}").write_text(",".join(agreed))
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_0s_delivery(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    expected = ",".join(rank_0 for rank_0, _ in CASES)
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == expected
