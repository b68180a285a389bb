"""The rawmm engine interface over vLLM 0.32's ``AsyncLLM``: our items fed to its engine as-is.

Each request's materialized items become ``MultiModalKwargsItem``s under the engine modality key
(``image``; Kimi: ``vision_chunk``), with one field element per tensor shaped the way vLLM's own
processors shape them (pixels flat, one row per patch; grids batched and kept on CPU). They enter the
engine through ``mm_input`` with the refs' content hashes and the placeholder ranges, so vLLM skips its
own processing; its encoder cache keys on the same content hashes. Before each request the items pass
through vLLM's own key-replicated sender cache (the API server's mirror of the engine core's receiver
cache), exactly as vLLM's processor path does: an item the engine core already holds crosses as its hash
alone, so a multi-turn request ships only its new images to the engine core. vLLM 0.32 does not keep the
two caches in step under concurrency (requests may reach the engine core in another order than they passed
the sender cache, and an evicting cache then misses): our requests are resent with their data, vLLM's own
routes answer such a request with a 500.

Pixels are ``uint8`` (``LoadedProcessor.pixels``) whenever vLLM runs the model with
``mm_device_do_normalize``: its vision tower rescales and normalizes on the device, exactly as for its
own processor's output, so an HF-normalized float would be normalized twice.

A weight update pauses the engine (in-flight requests finish, new ones wait), reloads in place, resets
the encoder cache (the worker's reload clears its encoder outputs but not the scheduler's record of them),
drops the prefix cache, and resumes. The pause covers vLLM's own completion routes too, so no request runs
on half-loaded weights. It leaves vLLM's multimodal caches alone: they hold processor outputs, which do not
depend on the weights, and vLLM's ``pause_generation(clear_cache=True)`` clears them out of step (the
sender cache when the pause starts, the receiver cache when the drain ends), so a chat request that
rendered in between made the next request with its image a multimodal-cache miss, a 500 on vLLM's routes.

Weights also arrive by broadcast (docs/architecture.md §6.1), through vLLM's own weight-transfer API
(``AsyncLLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, each a ``collective_rpc`` to the worker in the engine core) with rawmm's
``rawmm_gloo`` backend (``rawmm.serving.vllm_weight_transfer``). The update keeps the reload's guarantees:
start holds the weights gate and pauses vLLM the same way (running requests finish on the old weights);
finish resets the encoder and prefix caches, resumes, and only then moves the version. A receive that broke
off midway leaves weights of unknown provenance: the engine refuses to generate (503) until it loads a
checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
from vllm.exceptions import VLLMClientError
from vllm.inputs import mm_input, tokens_input
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalKwargsItems,
    PlaceholderRange,
)
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from rawmm.contract.engine_api import Sampling
from rawmm.contract.weight_transfer import TransferInit, TransferUpdate
from rawmm.materialize import EngineItem, FieldKind, LoadedProcessor
from rawmm.serving import metrics
from rawmm.serving.engine import Engine, EngineUnavailable, Generation, ImageInput, InvalidRequest
from rawmm.serving.vllm_weight_transfer import WEIGHTS_DO_NOT_FIT

log = logging.getLogger(__name__)


def to_vllm_item(item: EngineItem) -> MultiModalKwargsItem:
    """One engine item as vLLM's per-item kwargs (the same elements its own processors would build)."""
    elems = {}
    for key, tensor in item.tensors.items():
        if item.kinds[key] is FieldKind.FLAT:
            field: Any = MultiModalFlatField(slices=[slice(0, tensor.shape[0])], dim=0)
        else:
            # Our batched fields are the per-image grids: vLLM's Qwen and Kimi processors keep them on CPU.
            field = MultiModalBatchedField(keep_on_cpu=True)
        elems[key] = MultiModalFieldElem(data=tensor, field=field)
    return MultiModalKwargsItem(elems)


def build_engine_input(token_ids: list[int], images: Sequence[ImageInput]) -> Any:
    """vLLM's engine input for a prompt and its materialized images (prompt order).

    The prompt already holds one placeholder token per vision embedding, the length vLLM's own processors
    expand an image to (Qwen's ``<|image_pad|>`` run, Kimi's ``<|media_pad|>`` run: docs/architecture.md
    §3.4), and materialization checked each span against its image's grid; so spans pass through as they are.
    """
    if not images:
        return tokens_input(list(token_ids))
    kwargs: dict[str, list[MultiModalKwargsItem]] = {}
    hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[PlaceholderRange]] = {}
    for image in sorted(images, key=lambda image: image.feature.offset):
        feature = image.feature
        placeholders.setdefault(feature.modality, []).append(
            PlaceholderRange(offset=feature.offset, length=feature.length)
        )
        kwargs.setdefault(feature.modality, []).append(to_vllm_item(image.item))
        hashes.setdefault(feature.modality, []).append(feature.ref.mm_hash)
    return mm_input(
        prompt_token_ids=list(token_ids),
        mm_kwargs=MultiModalKwargsItems(kwargs),
        mm_hashes=hashes,
        mm_placeholders=placeholders,
    )


def through_sender_cache(engine_input: Any, cache: Any | None) -> int:
    """Let vLLM's sender cache (P0) clear, in place, the data of items its receiver cache (P1) holds.

    The order is the one vLLM's processor uses and the engine core replays: every hash touched first (so
    none of this request's items is evicted by another), then each item updated in prompt order. Without
    a cache (``--mm-processor-cache-gb 0``) every item crosses. Returns the tensor bytes that cross.
    """
    if engine_input["type"] != "multimodal":
        return 0
    if cache is not None:
        for hashes in engine_input["mm_hashes"].values():
            for mm_hash in hashes:
                cache.touch_sender_cache_item(mm_hash)
    sent = 0
    kept: dict[str, list[Any]] = {}
    for modality, items in engine_input["mm_kwargs"].items():
        kept[modality] = []
        for item, mm_hash in zip(items, engine_input["mm_hashes"][modality], strict=True):
            data = item if cache is None else cache.get_and_update_item((item, []), mm_hash)[0]
            kept[modality].append(data)
            if data is not None:
                sent += sum(elem.data.nbytes for elem in item.values())
    engine_input["mm_kwargs"] = MultiModalKwargsItems(kept)
    return sent


def to_sampling_params(sampling: Sampling) -> SamplingParams:
    """vLLM's sampling parameters for ``sampling`` (its temperature checked by ``Engine.check_request``: vLLM
    would silently raise one below ``MIN_TEMPERATURE`` to it)."""
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's own logprob only
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def checkpoint_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor of a safetensors checkpoint directory (headers only)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(
            f"weights path {str(path)!r} holds no *.safetensors files", reason="not_a_checkpoint"
        )
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    sliced = handle.get_slice(name)
                    tensors[name] = (sliced.get_dtype(), tuple(sliced.get_shape()))
        except (OSError, ValueError, SafetensorError) as exc:
            raise InvalidRequest(f"cannot read {str(file)!r}: {exc}", reason="unloadable_weights") from None
    return tensors


def misfits(served: dict[str, Any], offered: dict[str, Any]) -> list[str]:
    """Tensor names that are missing from either side or differ in dtype or shape."""
    return sorted(name for name in served.keys() | offered.keys() if served.get(name) != offered.get(name))


class VllmEngine(Engine):
    """The rawmm engine interface over a running vLLM ``EngineClient`` (``AsyncLLM``)."""

    def __init__(self, client: Any, processor: LoadedProcessor, tokenizer: Any) -> None:
        super().__init__()
        self.client = client
        self.processor = processor
        model_config = client.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self.placeholder_token_id = int(tokenizer.convert_tokens_to_ids(processor.family.placeholder_token))
        self.weights_path = Path(model_config.model)
        self._served_tensors = checkpoint_tensors(self.weights_path)
        self._broken: str | None = None  # why the engine cannot serve (a reload that could not be undone)
        self._handing_over: set[asyncio.Future[None]] = set()  # abandoned requests' hand-overs in flight
        # The served weights are weights_path's (a failed reload can restore them), not a broadcast's.
        self._from_checkpoint = True
        # Why the served weights cannot be trusted (a broadcast broke off midway) until a checkpoint loads.
        self._stale: str | None = None
        # Broadcast updates: the group's init answered; the open update (the gate held and vLLM paused from
        # start to finish); the worker's update open; a receive in flight; why the update cannot finish.
        self._transfer_ready = False
        self._update: AsyncExitStack | None = None
        self._worker_update = False
        self._receiving: asyncio.Future[None] | None = None
        self._update_error: str | None = None

    async def check_health(self) -> None:
        if self._broken is not None:
            raise EngineUnavailable(self._broken)
        try:
            await self.client.check_health()
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the vLLM engine core is dead: {exc}") from exc

    async def generate(
        self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling
    ) -> Generation:
        params = to_sampling_params(sampling)
        engine_input = build_engine_input(token_ids, images)
        prompt_length = len(engine_input["prompt_token_ids"])
        if prompt_length + sampling.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"{prompt_length} prompt tokens + max_tokens {sampling.max_tokens} "
                f"exceed the model's {self.max_model_len}-token context",
                reason="prompt_too_long",
            )
        async with self.gate.generating() as version:
            if self._broken is not None:
                raise EngineUnavailable(self._broken)
            if self._stale is not None:
                raise EngineUnavailable(f"weights must be reloaded from a checkpoint: {self._stale}")
            final = await self._generate_once(engine_input, params)
            if final is not None and final.outputs and final.outputs[0].finish_reason == "error":
                # The engine core missed an item the sender cache took for held (the two caches drifted,
                # e.g. concurrent requests reached it in another order): vLLM dropped those hashes from
                # the sender cache, so the retry carries their data.
                log.warning("engine-core multimodal cache miss; resending the request with its items")
                metrics.ENGINE_CORE_RESENDS.inc()
                final = await self._generate_once(build_engine_input(token_ids, images), params)
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output")
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished the request with {completion.finish_reason!r}")
        generated = list(completion.token_ids)
        logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(generated)]
        return Generation(generated, logprobs, completion.finish_reason, version)

    async def _generate_once(self, engine_input: Any, params: SamplingParams) -> Any:
        """One engine request: its items through the sender cache, then vLLM's generate; the final output.

        Cancelled (the client went away), vLLM's generate aborts the request in the engine core."""
        request_id = f"rawmm-{uuid.uuid4().hex}"
        dedupe = asyncio.ensure_future(self._dedupe(engine_input))
        try:
            sent = await asyncio.shield(dedupe)
        except asyncio.CancelledError:
            # Shielded and referenced: a second cancel (shutdown) must not skip the hand-over.
            hand_over = asyncio.ensure_future(
                self._hand_over_abandoned(dedupe, request_id, engine_input, params)
            )
            self._handing_over.add(hand_over)
            hand_over.add_done_callback(self._handing_over.discard)
            await asyncio.shield(hand_over)
            raise
        counted = [item for items in engine_input.get("mm_kwargs", {}).values() for item in items]
        metrics.ENGINE_CORE_ITEMS.labels(sent="data").inc(sum(item is not None for item in counted))
        metrics.ENGINE_CORE_ITEMS.labels(sent="hash").inc(sum(item is None for item in counted))
        metrics.ENGINE_CORE_ITEM_BYTES.inc(sent)
        final = None
        try:
            async for output in self.client.generate(engine_input, params, request_id):
                final = output
        except VLLMClientError as exc:
            # vLLM's own validation (prompt past max_model_len after expansion, an image over the
            # encoder budget, ...): the request's fault.
            raise InvalidRequest(f"vLLM rejected the request: {exc}", reason="engine_rejected") from None
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the vLLM engine core is dead: {exc}") from exc
        return final

    async def _hand_over_abandoned(
        self, dedupe: asyncio.Future[int], request_id: str, engine_input: Any, params: SamplingParams
    ) -> None:
        """A request cancelled while its items pass the sender cache: once they have, that cache takes them
        as held by the engine core, whose receiver cache takes them only from a request it receives. So the
        request is still sent, and aborted at once; otherwise a later request would send their hashes
        alone to an engine core that never had them."""
        try:
            await dedupe
            # One token at most, should the engine core schedule it before the abort lands.
            params = params.clone()
            params.max_tokens = 1
            collector = await self.client.add_request(request_id, engine_input, params)
            await self.client.abort(collector.request_id, internal=True)
        except Exception:
            log.exception("handing an abandoned request's items to the engine core failed")

    async def _dedupe(self, engine_input: Any) -> int:
        renderer = getattr(self.client, "renderer", None)
        cache = getattr(renderer, "mm_processor_cache", None)
        if renderer is None or cache is None:
            return through_sender_cache(engine_input, None)
        # vLLM touches this cache only from the renderer's one multimodal worker thread (its P0/P1 order
        # depends on it); so do we.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(renderer._mm_executor, through_sender_cache, engine_input, cache)

    async def load_weights(self, path: str) -> int:
        """Reload in place from checkpoint directory ``path`` (same tensors, dtypes and shapes as served).

        The version advances only when the reload and every cache reset succeeded. A reload that fails
        midway is undone by reloading the previous checkpoint; if that fails too, the engine reports
        itself unhealthy rather than serve weights of unknown provenance.
        """
        target = Path(path)
        if not target.is_dir():
            raise InvalidRequest(
                f"weights path {path!r} is not a checkpoint directory", reason="not_a_checkpoint"
            )
        bad = misfits(self._served_tensors, checkpoint_tensors(target))
        if bad:
            raise InvalidRequest(
                f"weights at {path!r} do not fit the served model: {bad[:5]}", reason="weights_do_not_fit"
            )
        async with self.gate.updating():
            # "wait": requests already running (vLLM's own routes included) finish on the old weights;
            # new ones queue until resume. No clear_cache: _reload resets the caches the weights touch.
            await self.client.pause_generation(mode="wait", clear_cache=False)
            try:
                try:
                    await self._reload(target)
                except Exception as exc:
                    if not self._from_checkpoint:
                        # The served weights came by broadcast: no checkpoint holds them to restore.
                        log.exception("reloading weights from %s failed", target)
                        self._stale = f"reloading {target} failed midway ({exc!r})"
                        raise
                    log.exception("reloading weights from %s failed; restoring %s", target, self.weights_path)
                    await self._restore(exc)
                    raise
                self.weights_path = target
                self._from_checkpoint = True
                self._stale = None
            finally:
                await self.client.resume_generation()
        return self.gate.version

    async def _reload(self, path: Path) -> None:
        await self.client.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        # The workers' reload dropped their encoder outputs; the scheduler still lists them as cached.
        await self.client.reset_encoder_cache()
        if not await self.client.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after the reload")

    async def _restore(self, cause: Exception) -> None:
        try:
            await self._reload(self.weights_path)
        except Exception as exc:
            self._broken = (
                f"weights reload failed ({cause!r}) and restoring the previous ones failed ({exc!r})"
            )
            log.error("%s", self._broken)

    # The broadcast path (rawmm.contract.weight_transfer), over vLLM's weight-transfer API.

    async def init_weight_transfer(self, info: TransferInit) -> str:
        if self._update is not None:
            # A sender inits only between its updates: this one's sender went away mid-update (the trainer
            # restarted). Its update ends unfinished, moving no version, and generation resumes.
            log.warning("a new weight transfer init ends the unfinished update of the previous sender")
            await self._end_update("abandoned by its sender")
        # The worker joins the group on a thread of its own (vllm_weight_transfer): this answers at once.
        await self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info.model_dump()))
        self._transfer_ready = True
        (served, *_) = await self.client.collective_rpc("rawmm_served_dtype")  # one worker per replica
        return str(served)

    async def start_weight_update(self) -> None:
        if not self._transfer_ready:
            raise InvalidRequest("init the weight transfer first", reason="weight_transfer_not_initialized")
        if self._update is not None:
            raise InvalidRequest("a weight update is already in progress", reason="weight_update_active")
        stack = AsyncExitStack()
        self._update = stack  # claimed before the waits, so a second start is refused at once
        try:
            # As a reload: running generations (ours, and vLLM's own routes') finish on the old weights,
            # new ones wait for finish.
            await stack.enter_async_context(self.gate.updating())
            await self.client.pause_generation(mode="wait", clear_cache=False)
            stack.push_async_callback(self.client.resume_generation)
            await self.client.start_weight_update()
        except BaseException as exc:
            self._update = None
            await stack.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._worker_update = True
        # Until a whole update is received, finishing it moves no version: nothing new is served.
        self._update_error = "no weights were received"

    async def update_weights(self, update: TransferUpdate) -> None:
        if self._update is None:
            raise InvalidRequest("start the weight update first", reason="weight_update_not_started")
        if self._receiving is not None:
            raise InvalidRequest("this update's weights are being received", reason="weight_update_active")
        # Shielded: a receive runs to its end (or the stream's), whatever happens to the request.
        self._receiving = asyncio.ensure_future(self._receive(update))
        await asyncio.shield(self._receiving)

    async def _receive(self, update: TransferUpdate) -> None:
        try:
            await self.client.update_weights(WeightTransferUpdateRequest(update_info=update.model_dump()))
        except Exception as exc:
            self._worker_update = False  # the worker closed its update with the failure
            message = str(exc)
            if WEIGHTS_DO_NOT_FIT in message:  # drained, nothing loaded: the old weights stay whole
                problem = message.split(f"{WEIGHTS_DO_NOT_FIT}: ", 1)[-1]
                self._update_error = problem
                raise InvalidRequest(
                    f"the sent weights do not fit the served model: {problem}", reason="weights_do_not_fit"
                ) from None
            self._update_error = f"the weight broadcast broke off: {message}"
            self._stale = self._update_error  # some tensors may be new, some old
            raise
        finally:
            self._receiving = None
        self._update_error = None

    async def finish_weight_update(self) -> int:
        receiving = self._receiving
        if receiving is not None:  # the sender gave up on its update: its receive ends first
            await asyncio.wait((receiving,))
        stack, self._update = self._update, None
        if stack is None:
            raise InvalidRequest("no weight update to finish", reason="weight_update_not_started")
        try:
            if self._worker_update:
                self._worker_update = False
                await self.client.finish_weight_update()  # the worker's layerwise reload completes
            if self._update_error is None:
                # What the reload resets, for the same reasons (encoder outputs and prefixes of old weights).
                await self.client.reset_encoder_cache()
                if not await self.client.reset_prefix_cache():
                    raise RuntimeError("vLLM could not reset its prefix cache after the update")
        except Exception as exc:
            log.exception("finishing the weight update failed")
            if self._update_error is None:
                self._update_error = f"finishing the update failed: {exc!r}"
                self._stale = self._update_error
        if self._update_error is not None:
            # Resume without moving the version: the update did not happen.
            await stack.__aexit__(RuntimeError, RuntimeError(self._update_error), None)
            raise InvalidRequest(
                f"the weight update failed: {self._update_error}", reason="weight_update_failed"
            )
        # Every served tensor was received (the worker checked the update against the served model).
        self._stale = None
        self._from_checkpoint = False
        await stack.aclose()  # vLLM resumes, then the gate opens and the version moves
        return self.gate.version

    async def _end_update(self, why: str) -> None:
        """End an update its sender abandoned: nothing moves; weights that arrived make the engine stale."""
        receiving = self._receiving
        if receiving is not None:
            await asyncio.wait((receiving,))
        stack, self._update = self._update, None
        if stack is None:  # finished meanwhile
            return
        received = self._update_error is None  # the whole update arrived, it just was never finished
        try:
            if self._worker_update:
                self._worker_update = False
                await self.client.finish_weight_update()
        except Exception:
            log.exception("closing the abandoned weight update failed")
            received = True
        if received:
            self._stale = f"a weight update was {why} after its weights arrived"
        await stack.__aexit__(RuntimeError, RuntimeError(why), None)

    async def close(self) -> None:
        """Nothing to release: the vLLM engine client is shut down by the context that made it."""
