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
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from rawmm.materialize import EngineItem, FieldKind, LoadedProcessor
from rawmm.serving import metrics
from rawmm.serving.engine import Engine, EngineUnavailable, Generation, ImageInput, InvalidRequest

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
                    log.exception("reloading weights from %s failed; restoring %s", target, self.weights_path)
                    await self._restore(exc)
                    raise
                self.weights_path = target
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

    async def close(self) -> None:
        """Nothing to release: the vLLM engine client is shut down by the context that made it."""
