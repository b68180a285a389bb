"""`trainer.weight_transfer: broadcast`: each step's weights into every engine replica (docs/architecture.md §6.1).

At the end of a step, after the optimizer step, every trainer rank calls ``send``:

1. Rank 0 checks that every replica of ``inference.urls`` answers ``/health``; when it has no broadcast group
   (the first step, or the last update failed) it builds one (``BroadcastSender.trainer_init``: every
   replica joins as rank 1..N). A replica down means no broadcast this step (a group without it would leave
   it behind unseen); the ranks learn rank 0's decision together, since under FSDP they gather in lockstep.
2. The update: the replicas pause, receive the weights (in the dtype they keep: ``wire_dtype``), resume,
   and their versions move. Rank 0 then writes ``checkpoints/weights_step`` (``RunConfig.weights_step_path``):
   the orchestrator, which waits on it, goes on before the checkpoint is written.
3. The step's checkpoint is written as in checkpoint mode, when due (``trainer.checkpoint_every``; the ranks
   agree on rank 0's delivery first, ``agreed_delivery``): what a resume reads, and what a replica that
   missed an update catches up from.
4. ``after_checkpoint``: when the update was skipped or failed, rank 0 has every replica load that
   checkpoint (``/v1/rawmm/weights``, what the orchestrator does in checkpoint mode), then writes
   ``weights_step``. A replica out of reach then is behind: the orchestrator's replica pool finds it (down,
   or answering on an older weights version) and has it load the latest checkpoint before it serves again.

A trainer that restarts resumes from the latest checkpoint, which with ``trainer.checkpoint_every`` above 1
(or a restart between a broadcast and its checkpoint) is behind ``weights_step``: the replicas already hold
a newer step's weights. The steps it trains again up to ``weights_step`` send nothing (``"held"``): sending
them would take the replicas, and ``weights_step``, back to older weights than the rollouts already sampled
with; the first new step broadcasts as usual.

Rank 0 needs the weights token (``$RAWMM_WEIGHTS_TOKEN``) and a network path both ways to every replica:
the replicas connect to its rendezvous (``$RAWMM_WEIGHT_TRANSFER_ADDRESS``, by default this host's address
on the route to the first replica; ``$RAWMM_WEIGHT_TRANSFER_PORT``, by default a free port), and it
connects to each replica's gloo port (chosen by the replica at init).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx
import torch

from rawmm.contract.engine_api import HEALTH_PATH
from rawmm.contract.files import write_atomically
from rawmm.contract.shared_dir import read_step
from rawmm.contract.weight_transfer import DEFAULT_BUCKET_BYTES
from rawmm.rl.trainer.distributed import DistContext, all_reduce_sum
from rawmm.rl.trainer.weight_broadcast import BroadcastSender
from rawmm.rl.trainer.weight_sync_client import HttpWeightSyncClient

log = logging.getLogger(__name__)

ADDRESS_ENV = "RAWMM_WEIGHT_TRANSFER_ADDRESS"
PORT_ENV = "RAWMM_WEIGHT_TRANSFER_PORT"

# How this step's weights reached the replicas: sent, or (the send skipped or failed) reloaded from its
# checkpoint; "held": a step a restarted trainer trains again, whose weights (or a later step's) the
# replicas hold already; "checkpoint" on a run in checkpoint mode.
Delivery = Literal["checkpoint", "broadcast", "reload", "held"]


@dataclass(frozen=True)
class Published:
    delivery: Delivery
    seconds: float  # rank 0: the update (start..finish), or the reload; 0 on other ranks
    versions: dict[str, int]  # rank 0: each replica's weights version after it (reloads that failed: absent)


def local_address_towards(url: str) -> str:
    """This host's address on the route to the replica at ``url`` (what the replicas reach us at)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        probe.connect((socket.gethostbyname(host), port))
        return str(probe.getsockname()[0])


def write_weights_step(path: Path, step: int) -> None:
    write_atomically(path, f"{step}\n".encode())


SenderFactory = Callable[..., BroadcastSender]


class WeightPublisher:
    """One per trainer rank; rank 0 alone talks to the replicas."""

    def __init__(
        self,
        model: torch.nn.Module,
        urls: Sequence[str],
        dist: DistContext,
        *,
        sharded: bool,
        weights_step_path: Path,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        sender_factory: SenderFactory = BroadcastSender.trainer_init,
    ) -> None:
        if not urls:
            raise ValueError("trainer.weight_transfer broadcast needs the engines' URLs (inference.urls)")
        self.model, self.dist, self.sharded = model, dist, sharded
        self.weights_step_path = Path(weights_step_path)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._factory = sender_factory
        self.client = HttpWeightSyncClient(urls, timeout_s=max(timeout_s, 600.0)) if dist.is_main else None
        self.sender: BroadcastSender | None = None  # rank 0: the group; None until built, or after a failure
        self.master_address = os.environ.get(ADDRESS_ENV) or (
            local_address_towards(urls[0]) if dist.is_main else ""
        )
        self.master_port = int(os.environ.get(PORT_ENV, "0"))
        # Read once, before this trainer's first update writes it. Rank 0's reading, on every rank: a rank
        # that held a step while the others sent would leave them waiting in the send's collectives (and
        # another node's NFS client may still cache an older file).
        held = torch.tensor(
            [float(read_step(self.weights_step_path)) if dist.is_main else 0.0],
            dtype=torch.float64,
            device=dist.device,
        )
        self.held_through = int(all_reduce_sum(held)[0])

    @property
    def urls(self) -> list[str]:
        return self.client.urls if self.client is not None else []

    def send(self, step: int) -> Published:
        """Every rank, after the optimizer step: broadcast the weights if every replica is up."""
        if step <= self.held_through:
            log.info("weights of step %d: the replicas hold step %d's already", step, self.held_through)
            return Published("held", 0.0, {})
        started = time.perf_counter()
        ready = self._ready() if self.dist.is_main else False
        if self.sharded and self.dist.world_size > 1:  # the others gather only if rank 0 sends
            flag = torch.tensor([1.0 if ready else 0.0], dtype=torch.float64, device=self.dist.device)
            ready = bool(all_reduce_sum(flag)[0] > 0)
        if not ready:
            return Published("reload", 0.0, {})
        if not self.dist.is_main:
            BroadcastSender(self.model, None, bucket_bytes=self.bucket_bytes).send_weights()  # the gathers
            return Published("broadcast", 0.0, {})
        assert self.sender is not None
        try:
            report = self.sender.send_weights(str(step))
        except Exception as exc:  # noqa: BLE001 - any failure: the step's checkpoint brings every replica up
            log.error(
                "weights of step %d: the broadcast failed (%s); the replicas reload its checkpoint", step, exc
            )
            self.sender = None  # rebuilt before the next update (send_weights shut the group down)
            return Published("reload", 0.0, {})
        assert report is not None
        write_weights_step(self.weights_step_path, step)
        log.info(
            "weights of step %d broadcast to %d replicas in %.2fs (%d bytes each, %d buckets): versions %s",
            step, len(report.versions), time.perf_counter() - started, report.bytes_sent, report.buckets,
            report.versions,
        )  # fmt: skip
        return Published("broadcast", report.seconds, report.versions)

    def agreed_delivery(self, sent: Published) -> Delivery:
        """Rank 0's delivery of the step, on every rank (a collective: every rank calls it). Whether the step
        writes its checkpoint follows from it, and a checkpoint's gather and barrier take every rank, while
        only rank 0 knows whether the replicas got the weights (the others report a reload under DDP)."""
        if self.dist.world_size == 1 or sent.delivery == "held":  # every rank holds the same step bound
            return sent.delivery
        sent_by_broadcast = self.dist.is_main and sent.delivery == "broadcast"
        flag = torch.tensor([1.0 if sent_by_broadcast else 0.0], dtype=torch.float64, device=self.dist.device)
        return "broadcast" if all_reduce_sum(flag)[0] > 0 else "reload"

    def after_checkpoint(self, step: int, checkpoint: Path, sent: Published) -> Published:
        """Rank 0, once the step's checkpoint is published: when the weights did not go out by broadcast,
        every replica loads the checkpoint; then ``weights_step`` moves to ``step``."""
        if sent.delivery != "reload" or self.client is None:
            return sent
        started = time.perf_counter()
        results = self.client.load_weights(str(Path(checkpoint).resolve()))
        versions = {url: v for url, v in results.items() if isinstance(v, int)}
        for url, result in results.items():
            if not isinstance(result, int):
                # Down or failing: the orchestrator revives it from the latest checkpoint before it serves.
                log.error("weights of step %d: replica %s did not load %s: %s", step, url, checkpoint, result)
        write_weights_step(self.weights_step_path, step)
        return Published("reload", time.perf_counter() - started, versions)

    def _ready(self) -> bool:
        """Rank 0: every replica answers, and the group is built (built now if need be)."""
        assert self.client is not None
        down = [url for url in self.client.urls if not _healthy(url)]
        if down:
            log.warning("weights broadcast skipped: replicas %s do not answer %s", down, HEALTH_PATH)
            if self.sender is not None:  # a member is gone (when it is back, it is not in the group)
                self.sender.shutdown()
                self.sender = None
            return False
        if self.sender is not None:
            return True
        try:
            self.sender = self._factory(
                self.model,
                self.client,
                master_address=self.master_address,
                master_port=self.master_port,
                bucket_bytes=self.bucket_bytes,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - this step's weights go by checkpoint; retried next step
            log.error("weights broadcast: building the group with %s failed: %s", self.client.urls, exc)
            return False
        log.info(
            "weights broadcast group built: rank 0 at %s, replicas %s", self.master_address, self.client.urls
        )
        return True

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
            self.sender = None
        if self.client is not None:
            self.client.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}{HEALTH_PATH}", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False
