"""The trainer's end of the weight broadcast (docs/architecture.md §6.1): vLLM's
``NCCLTrainerWeightTransferEngine`` shape (``trainer_init`` then ``send_weights`` on every trainer rank,
rank 0 the only sender), over gloo so that it runs, and is tested, on CPU.

Rank 0 opens the rendezvous (a TCPStore on ``master_address``; port 0 picks a free one) and sits at rank 0
of a gloo group with the N replicas at ranks 1..N. Each update streams the parameters in buckets
(``rawmm.contract.weight_transfer.plan_buckets``): a bucket's tensors are gathered (FSDP ``full_tensor()``,
a collective every trainer rank runs in the same order), packed into one ``uint8`` tensor, broadcast, and
dropped, so rank 0 never holds more than one bucket beyond its own shards. Non-sender ranks only take
part in the gathers. A floating parameter goes in the dtype the replicas serve when that is narrower than
the trainer's float32 (``wire_dtype``: bf16 engines get half the bytes), cast as a reload casts the
checkpoint's, so a replica that loads it holds what a reload of the same step's checkpoint would give it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rawmm.contract.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    TransferInit,
    TransferUpdate,
    dtype_name,
    plan_buckets,
    wire_dtype,
)


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``, with one init info per replica (each has its own rank)."""

    urls: list[str]

    def init_weight_transfer_engine(self, init_infos: list[dict[str, Any]]) -> list[str]:
        """Returns the dtype each replica serves its weights in."""
        ...

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


def update_info_of(model: torch.nn.Module, served: Sequence[str] = ()) -> TransferUpdate:
    """What will be sent to replicas serving the dtypes ``served``, from the global shapes alone (no
    gather): each tensor in its ``wire_dtype``."""
    names, dtypes, shapes = [], [], []
    for name, param in model.named_parameters():
        names.append(name)
        dtypes.append(wire_dtype(dtype_name(param.dtype), served))
        shapes.append(list(param.shape))
    return TransferUpdate(names=names, dtype_names=dtypes, shapes=shapes)


def packed_buckets(
    model: torch.nn.Module, update: TransferUpdate, bucket_bytes: int
) -> Iterator[torch.Tensor]:
    """Each bucket as one host ``uint8`` tensor, gathering its tensors on the way (every rank iterates, in
    the same parameter order), each cast to its wire dtype (round to nearest even, as a load's copy)."""
    params = [param for _, param in model.named_parameters()]
    wire = [getattr(torch, name) for name in update.dtype_names]
    for bucket in plan_buckets(update.sizes(), bucket_bytes):
        parts = [
            _full(params[i].detach()).to(wire[i]).contiguous().view(-1).view(torch.uint8).cpu()
            for i in bucket
        ]
        yield torch.cat(parts) if len(parts) > 1 else parts[0]


class BroadcastSender:
    """Build with ``trainer_init`` on every trainer rank; ``send_weights`` on every rank once per update."""

    def __init__(self, model: torch.nn.Module, client: WeightSyncClient | None, *, bucket_bytes: int) -> None:
        self.model, self.client, self.bucket_bytes = model, client, bucket_bytes
        self.group: dist.ProcessGroupGloo | None = None
        self._store: dist.TCPStore | None = None  # rank 0's rendezvous; outlives the group's join
        self.served_dtypes: tuple[str, ...] = ()  # rank 0: what each replica answered its init

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
        # Daemon threads: a join left waiting must not hold the process at exit until the timeout.
        inited = _in_daemon_thread(client.init_weight_transfer_engine, infos)
        joined = _in_daemon_thread(dist.ProcessGroupGloo, store, 0, world_size, options)
        wait([inited, joined], return_when=FIRST_EXCEPTION)
        sender.served_dtypes = tuple(inited.result())
        sender.group = joined.result()
        sender._store = store
        return sender

    def send_weights(self, weight_version: str | None = None) -> SendReport | None:
        """Push the model's parameters to every replica: start (they pause), update concurrently with the
        broadcast, finish (they resume, their versions move). The sender's report; None on other ranks.

        On a failure (a replica refuses a step, its connection breaks) the sender still runs every gather
        (the other trainer ranks take part in them, in order), destroys the group (so the replicas still
        receiving fail at once, not at the group's timeout: a new ``trainer_init`` is then needed), lets the
        replicas resume, and raises: a replica that did not get the whole update keeps its version."""
        update = update_info_of(self.model, self.served_dtypes)
        if self.client is None:
            for _ in packed_buckets(self.model, update, self.bucket_bytes):
                pass
            return None
        assert self.group is not None, "trainer_init first"
        started = time.perf_counter()
        sent = buckets = 0
        broadcast_seconds = 0.0
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            failure: BaseException | None = None
            try:
                self.client.start_weight_update()
            except BaseException as exc:  # noqa: BLE001 - raised below, once the gathers are done
                failure = exc
            receiving = None if failure else pool.submit(self.client.update_weights, update.model_dump())
            broadcast_started = time.perf_counter()
            for packed in packed_buckets(self.model, update, self.bucket_bytes):
                if failure is not None:
                    continue  # drain: the other trainer ranks gather this bucket too
                try:
                    if receiving is not None and receiving.done():  # refused before its receive began
                        receiving.result()
                    # No local name for the group: `failure` keeps this frame, and the group must die.
                    self.group.broadcast(packed, 0).wait()  # type: ignore[attr-defined]  # stubs lack it
                except BaseException as exc:  # noqa: BLE001 - raised below
                    failure = exc
                    self.shutdown()  # the replicas still receiving fail now, not at the timeout
                    continue
                sent += packed.numel()
                buckets += 1
            broadcast_seconds = time.perf_counter() - broadcast_started
            if receiving is not None:
                receiving.result()
            if failure is not None:
                raise failure
        except BaseException:
            # Unpause the replicas: those that failed keep their version (and refuse to serve weights
            # half-received until a checkpoint reload); the caller decides what the failure means.
            self.shutdown()
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(weight_version)
            raise
        finally:
            pool.shutdown(wait=False)
        versions = self.client.finish_weight_update(weight_version)
        return SendReport(time.perf_counter() - started, broadcast_seconds, sent, buckets, versions)

    def shutdown(self) -> None:
        """Close the group's connections, so that a replica still receiving fails at once. gloo's own
        ``shutdown()`` and ``abort()`` leave them open (the peer then waits out the group's timeout): only
        the group's destruction closes them, so no reference to it may outlive this call."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):  # a group whose peer is gone may fail its own shutdown
                group.shutdown()


def _in_daemon_thread(function: Any, *args: Any) -> Future[Any]:
    """`function(*args)` on a daemon thread, its outcome in the returned future."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:  # the caller re-raises it from the future
            future.set_exception(exc)

    threading.Thread(
        target=run, name=f"weight-broadcast-{getattr(function, '__name__', 'call')}", daemon=True
    ).start()
    return future
