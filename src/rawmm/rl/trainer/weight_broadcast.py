"""The trainer's end of the weight broadcast (docs/architecture.md §6.1): vLLM's
``NCCLTrainerWeightTransferEngine`` shape (``trainer_init`` then ``send_weights`` on every trainer rank,
rank 0 the only sender), over gloo so that it runs, and is tested, on CPU.

Rank 0 opens the rendezvous (a TCPStore on ``master_address``; port 0 picks a free one) and sits at rank 0
of a gloo group with the N replicas at ranks 1..N. Each update streams the parameters in buckets
(``rawmm.contract.weight_transfer.plan_buckets``): a bucket's tensors are gathered (FSDP ``full_tensor()``,
a collective every trainer rank runs in the same order), packed into one ``uint8`` tensor, broadcast, and
dropped, so rank 0 never holds more than one bucket beyond its own shards. Non-sender ranks only take
part in the gathers. The parameters go as the trainer holds them (float32), as the checkpoint has them,
so a replica that loads them holds what a reload of the same step's checkpoint would give it.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rawmm.contract.weight_transfer import DEFAULT_BUCKET_BYTES, TransferInit, TransferUpdate, plan_buckets


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``, with one init info per replica (each has its own rank)."""

    urls: list[str]

    def init_weight_transfer_engine(self, init_infos: list[dict[str, Any]]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> dict[str, int]: ...


@dataclass(frozen=True)
class SendReport:
    """One update as the sender saw it."""

    seconds: float  # start .. every replica finished: how long the engines were paused, at most
    broadcast_seconds: float  # the data moving
    bytes_sent: int  # per replica (a broadcast sends the same bytes to each)
    buckets: int
    versions: dict[str, int]  # each replica's weights version after the update


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP shard is gathered (a collective on every rank), a plain one passes."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def update_info_of(model: torch.nn.Module) -> TransferUpdate:
    """What will be sent, from the global shapes alone (no gather)."""
    names, dtypes, shapes = [], [], []
    for name, param in model.named_parameters():
        names.append(name)
        dtypes.append(str(param.dtype).removeprefix("torch."))
        shapes.append(list(param.shape))
    return TransferUpdate(names=names, dtype_names=dtypes, shapes=shapes)


def packed_buckets(
    model: torch.nn.Module, update: TransferUpdate, bucket_bytes: int
) -> Iterator[torch.Tensor]:
    """Each bucket as one host ``uint8`` tensor, gathering its tensors on the way (every rank iterates)."""
    params = [param for _, param in model.named_parameters()]
    for bucket in plan_buckets(update.sizes(), bucket_bytes):
        parts = [_full(params[i].detach()).contiguous().view(-1).view(torch.uint8).cpu() for i in bucket]
        yield torch.cat(parts) if len(parts) > 1 else parts[0]


class BroadcastSender:
    """Build with ``trainer_init`` on every trainer rank; ``send_weights`` on every rank once per update."""

    def __init__(self, model: torch.nn.Module, client: WeightSyncClient | None, *, bucket_bytes: int) -> None:
        self.model, self.client, self.bucket_bytes = model, client, bucket_bytes
        self.group: dist.ProcessGroupGloo | None = None
        self._store: dist.TCPStore | None = None  # rank 0's rendezvous; outlives the group's join

    @property
    def is_sender(self) -> bool:
        return self.client is not None

    @classmethod
    def trainer_init(
        cls,
        model: torch.nn.Module,
        client: WeightSyncClient | None,
        *,
        master_address: str,
        master_port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> BroadcastSender:
        """Rank 0 passes the client (and becomes the sender); other ranks pass None."""
        sender = cls(model, client, bucket_bytes=bucket_bytes)
        if client is None:
            return sender
        world_size = 1 + len(client.urls)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        infos = [
            TransferInit(
                master_address=master_address,
                master_port=store.port,
                rank_offset=1 + i,
                world_size=world_size,
                bucket_bytes=bucket_bytes,
                timeout_s=timeout_s,
            ).model_dump()
            for i in range(len(client.urls))
        ]
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        # The replicas block in their init until every rank has joined, and so does this rank: together.
        # A replica that refuses the init never joins, so its error is raised at once, not at the timeout
        # (the join left waiting then fails on its own when the timeout passes).
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            inited = pool.submit(client.init_weight_transfer_engine, infos)
            joined = pool.submit(dist.ProcessGroupGloo, store, 0, world_size, options)
            both: list[Future[Any]] = [inited, joined]
            wait(both, return_when=FIRST_EXCEPTION)
            inited.result()
            sender.group = joined.result()
        finally:
            pool.shutdown(wait=False)
        sender._store = store
        return sender

    def send_weights(self, weight_version: str | None = None) -> SendReport | None:
        """Push the model's parameters to every replica: start (they pause), update concurrently with the
        broadcast, finish (they resume, their versions move). The sender's report; None on other ranks."""
        update = update_info_of(self.model)
        if self.client is None:
            for _ in packed_buckets(self.model, update, self.bucket_bytes):
                pass
            return None
        assert self.group is not None, "trainer_init first"
        started = time.perf_counter()
        self.client.start_weight_update()
        sent = buckets = 0
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                receiving = pool.submit(self.client.update_weights, update.model_dump())
                broadcast_started = time.perf_counter()
                for packed in packed_buckets(self.model, update, self.bucket_bytes):
                    if receiving.done():  # refused before its receive began: nobody is listening
                        receiving.result()
                    self.group.broadcast(packed, 0).wait()  # type: ignore[attr-defined]  # stubs lack it
                    sent += packed.numel()
                    buckets += 1
                broadcast_seconds = time.perf_counter() - broadcast_started
                receiving.result()
        except BaseException:
            # Unpause the replicas: those that failed keep their version (and refuse to serve weights
            # half-received until a checkpoint reload); the caller decides what the failure means.
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(weight_version)
            raise
        versions = self.client.finish_weight_update(weight_version)
        return SendReport(time.perf_counter() - started, broadcast_seconds, sent, buckets, versions)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
