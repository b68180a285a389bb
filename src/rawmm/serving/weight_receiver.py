"""An engine replica's end of the weight broadcast (docs/architecture.md §6.1): a gloo group with the
trainer's sender, outside torch.distributed's default group (the engine has none), and the bucketed receive.

gloo is the CPU backend of the protocol vLLM runs over NCCL on GPUs: same rendezvous fields, same update
info, same bucket rule (``rawmm.contract.weight_transfer``). A bucket arrives as one ``uint8`` tensor and
its tensors are copied into the served parameters as views of it, so a replica holds one bucket beyond
its model, never a second model.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from rawmm.contract.weight_transfer import TransferInit, TransferUpdate, dtype_name, loads_into, plan_buckets

# Takes one bucket's ``(name, tensor)`` pairs: vLLM's ``model.load_weights`` has this shape.
Load = Callable[[list[tuple[str, torch.Tensor]]], None]


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the sender can reach us at); no packet sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def join_group(info: TransferInit) -> dist.ProcessGroupGloo:
    """Join the sender's rendezvous as rank ``info.rank_offset``; blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(
        info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout
    )
    # The options object is how a gloo group gets a timeout and a device bound to a chosen address.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    address = local_address_towards(info.master_address, info.master_port)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, info.rank_offset, info.world_size, options)


class WeightReceiver:
    """One replica's membership of the broadcast group, from init to shutdown."""

    def __init__(self, info: TransferInit) -> None:
        self.info = info
        self.group: dist.ProcessGroupGloo | None = join_group(info)

    def receive(self, update: TransferUpdate, load: Load | None) -> int:
        """Receive every bucket of ``update`` and hand its tensors to ``load`` (views of the bucket, valid
        during the call); with ``load`` None, drain the stream without loading anything (the update was
        refused, and the sender must not hang). Returns the bytes received."""
        if self.group is None:
            raise RuntimeError("this replica left the weight broadcast group")
        sizes = update.sizes()
        received = 0
        for bucket in plan_buckets(sizes, self.info.bucket_bytes):
            buffer = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()  # type: ignore[attr-defined]  # stubs: no collectives
            received += buffer.numel()
            if load is None:
                continue
            tensors, offset = [], 0
            for i in bucket:
                dtype = getattr(torch, update.dtype_names[i])
                tensors.append(
                    (update.names[i], buffer[offset : offset + sizes[i]].view(dtype).view(update.shapes[i]))
                )
                offset += sizes[i]
            load(tensors)
        return received

    def shutdown(self) -> None:
        """Close the group's connections (the sender then fails at once): gloo's ``shutdown()`` leaves them
        open, only the group's destruction closes them, so this drops the last reference."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()


def copy_into(params: Mapping[str, torch.Tensor]) -> Load:
    """A ``Load`` that copies each tensor into the parameter of its name (the transformers engine)."""

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in tensors:
                params[name].copy_(tensor)

    return load


def fit_problem(update: TransferUpdate, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``update`` cannot load into ``params`` (names, shapes, dtypes: ``loads_into``), or None."""
    names = set(update.names)
    missing, extra = sorted(params.keys() - names), sorted(names - params.keys())
    if missing or extra:
        return f"tensors not sent: {missing[:5]}; tensors not served: {extra[:5]}"
    if len(names) != len(update.names):
        return "a tensor is sent twice"
    for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
        param = params[name]
        if list(param.shape) != shape or not loads_into(dtype, dtype_name(param.dtype)):
            return f"{name}: sent {dtype} {shape}, served {param.dtype} {list(param.shape)}"
    return None
