"""A CPU engine on transformers' Qwen2-VL / Qwen3-VL / Kimi K2.5 classes, consuming materialized items.

Generation runs on one dedicated thread, one request at a time (correctness first): a prefill with the
prompt and its images' ``pixel_values`` and grid (plus ``mm_token_type_ids`` for Qwen, which computes its
own M-RoPE positions from them; Kimi's positions are plain), then token-by-token decoding on the KV cache.
Weight updates run on the same thread between requests, behind the ``WeightsGate``. A cancelled request
(its client went away) stops decoding before its next token.

Items carry the pixels of the processor's representation: ``uint8`` items (a quarter of float32 in the
materialize cache) are normalized on use, per request, bit-exact to the processor's normalized pixels.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import torch

from rawmm.contract.engine_api import Sampling
from rawmm.contract.weight_transfer import TransferInit, TransferUpdate, dtype_name, served_dtype_of
from rawmm.materialize import LoadedProcessor, collate, get_adapter
from rawmm.materialize.normalize import PixelNormalizer
from rawmm.serving.engine import Engine, EngineUnavailable, Generation, ImageInput, InvalidRequest
from rawmm.serving.sampling import sample_token
from rawmm.serving.weight_receiver import WeightReceiver, copy_into, fit_problem

log = logging.getLogger(__name__)


def _load_model(path: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return model.eval()


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class TransformersEngine(Engine):
    def __init__(
        self, model_path: str, processor: LoadedProcessor, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.processor = processor
        self.adapter = get_adapter(processor.family.name)
        self.normalizer = PixelNormalizer(processor) if processor.pixels == "uint8" else None
        self.model = _load_model(model_path, dtype)  # a reload reads float32 and casts into it
        text_config = self.model.config.get_text_config()
        self.placeholder_token_id = int(self.model.config.image_token_id)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_model_len = int(text_config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(self.model)
        # One thread: the model and its cached M-RoPE deltas belong to one request at a time.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rawmm-engine")
        # Broadcast updates: the group, the open update (the gate held from start to finish), and why the
        # weights cannot be trusted (a receive broke off midway) until a checkpoint is loaded.
        self._receiver: WeightReceiver | None = None
        self._update: AsyncExitStack | None = None
        self._update_error: str | None = None
        self._stale: str | None = None

    async def check_health(self) -> None:
        """In process: the engine can serve whenever the server answers."""

    async def generate(
        self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling
    ) -> Generation:
        async with self.gate.generating() as version:
            if self._stale is not None:
                raise EngineUnavailable(f"weights must be reloaded from a checkpoint: {self._stale}")
            stop = threading.Event()
            job = self._thread.submit(self._generate_sync, token_ids, list(images), sampling, stop)
            running = asyncio.wrap_future(job)
            try:
                token_ids_out, logprobs, finish = await asyncio.shield(running)
            except asyncio.CancelledError:
                # Abandoned: a queued job never starts, a running one stops before its next token. Wait for
                # the thread to let go of the images (the caller's lease on them ends with this call).
                stop.set()
                job.cancel()
                await asyncio.wait((running,))
                running.cancelled() or running.exception()  # whatever it raised, nobody wants it now
                raise
        return Generation(token_ids_out, logprobs, finish, version)

    @torch.inference_mode()
    def _generate_sync(
        self, token_ids: list[int], images: list[ImageInput], sampling: Sampling, stop: threading.Event
    ) -> tuple[list[int], list[float], str]:
        model = self.model
        model.model.rope_deltas = None  # cached per request by Qwen; never let one leak into the next
        inputs: dict[str, Any] = {"input_ids": torch.tensor([token_ids])}
        if images:
            mm_kwargs = collate([image.item for image in images])
            inputs.update(
                self.adapter.model_kwargs(self.normalizer.inputs(mm_kwargs) if self.normalizer else mm_kwargs)
            )
            if self.adapter.forward_policy.requires_mm_token_type_ids:
                token_types = torch.zeros(1, len(token_ids), dtype=torch.int32)
                for image in images:
                    token_types[0, image.feature.offset : image.feature.offset + image.feature.length] = 1
                inputs["mm_token_type_ids"] = token_types
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        out = model(**inputs, use_cache=True, logits_to_keep=1)
        generated: list[int] = []
        logprobs: list[float] = []
        for _ in range(sampling.max_tokens):
            if stop.is_set():
                break  # abandoned: the caller discards what was generated
            token, logprob = sample_token(
                out.logits[0, -1], temperature=sampling.temperature, top_p=sampling.top_p, generator=generator
            )
            generated.append(token)
            logprobs.append(logprob)
            if token in self.eos_token_ids:
                return generated, logprobs, "stop"
            out = model(
                input_ids=torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
        return generated, logprobs, "length"

    async def load_weights(self, path: str) -> int:
        if not Path(path).is_dir():
            raise InvalidRequest(
                f"weights path {path!r} is not a checkpoint directory", reason="not_a_checkpoint"
            )
        try:
            # Read (and convert) the checkpoint off the engine thread: generation goes on meanwhile.
            fresh = await asyncio.to_thread(_load_model, path)
        except Exception as exc:  # noqa: BLE001 - whatever breaks reading the client's checkpoint (a bad
            # header, a cut file, a config.json of `null`) touched only the fresh model: the served one is whole
            raise InvalidRequest(
                f"cannot load weights from {path!r}: {exc}", reason="unloadable_weights"
            ) from None
        new_state = fresh.state_dict()
        # Same tensors and shapes, or the update is refused and the old weights stay whole.
        current = self.model.state_dict()
        misfit = sorted(
            k
            for k in current.keys() | new_state.keys()
            if k not in current or k not in new_state or current[k].shape != new_state[k].shape
        )
        if misfit:
            raise InvalidRequest(
                f"weights at {path!r} do not fit the served model: {misfit[:5]}", reason="weights_do_not_fit"
            )
        async with self.gate.updating():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._thread, self.model.load_state_dict, new_state)
            self._stale = None
        return self.gate.version

    async def init_weight_transfer(self, info: TransferInit) -> str:
        if self._update is not None:
            # A sender inits only between its updates: this one's sender went away mid-update (the trainer
            # restarted). Its update ends unfinished, moving no version, and generation resumes.
            stack, self._update = self._update, None
            log.warning("a new weight transfer init ends the unfinished update of the previous sender")
            await stack.__aexit__(RuntimeError, RuntimeError("abandoned by its sender"), None)
        # Blocks until every rank has joined: off the event loop, which keeps serving meanwhile.
        receiver = await asyncio.to_thread(WeightReceiver, info)
        if self._receiver is not None:  # a new sender (the trainer restarted) replaces the old group
            self._receiver.shutdown()
        self._receiver = receiver
        return served_dtype_of(dtype_name(param.dtype) for param in self.model.parameters())

    async def start_weight_update(self) -> None:
        if self._receiver is None:
            raise InvalidRequest("init the weight transfer first", reason="weight_transfer_not_initialized")
        if self._update is not None:
            raise InvalidRequest("a weight update is already in progress", reason="weight_update_active")
        stack = AsyncExitStack()
        self._update = stack  # claimed before the wait, so a second start is refused at once
        try:  # pause: running generations finish on the old weights, new ones wait for finish
            await stack.enter_async_context(self.gate.updating())
        except BaseException:
            self._update = None
            raise
        # Until a whole update is received, finishing it moves no version: nothing new is served.
        self._update_error = "no weights were received"

    async def update_weights(self, update: TransferUpdate) -> None:
        if self._update is None or self._receiver is None:
            raise InvalidRequest("start the weight update first", reason="weight_update_not_started")
        params = dict(self.model.named_parameters())
        problem = fit_problem(update, params)
        loop = asyncio.get_running_loop()
        try:
            # A misfit still drains the stream (no load): the sender is broadcasting already.
            await loop.run_in_executor(
                self._thread, self._receiver.receive, update, None if problem else copy_into(params)
            )
        except Exception as exc:
            self._update_error = f"the weight broadcast broke off: {exc!r}"
            if problem is None:  # some tensors may be new, some old
                self._stale = self._update_error
            raise
        if problem is not None:
            self._update_error = problem
            raise InvalidRequest(f"the sent weights do not fit the served model: {problem}",
                                 reason="weights_do_not_fit")  # fmt: skip
        self._update_error = None

    async def finish_weight_update(self) -> int:
        stack, self._update = self._update, None
        if stack is None:
            raise InvalidRequest("no weight update to finish", reason="weight_update_not_started")
        if self._update_error is not None:
            # Leave the gate without moving the version: the update did not happen.
            await stack.__aexit__(RuntimeError, RuntimeError(self._update_error), None)
            raise InvalidRequest(
                f"the weight update failed: {self._update_error}", reason="weight_update_failed"
            )
        await stack.aclose()
        return self.gate.version

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.shutdown()
        self._thread.shutdown(wait=True)
