"""VllmEngine's side of the weight broadcast against a scripted engine client: the order of vLLM's calls
(pause, the worker's start/update/finish, cache resets, resume), the version moving only at a finished
update, and the failures a real server cannot stage cheaply. The real engine is test_vllm_serve_broadcast.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_vllm_engine_unit import ScriptedClient, engine_for

from rawmm.contract.engine_api import Sampling
from rawmm.contract.weight_transfer import TransferInit, TransferUpdate
from rawmm.serving.engine import EngineUnavailable, InvalidRequest

pytestmark = pytest.mark.slow  # imports vllm (~10 s)

INIT = TransferInit(master_address="127.0.0.1", master_port=29501, rank_offset=1, world_size=2)
UPDATE = TransferUpdate(names=["a", "b"], dtype_names=["float32", "float32"], shapes=[[2], [3]])
# What vLLM's collective_rpc raises for a worker's exception: its message, and nothing else.
MISFIT = Exception("Call to collective_rpc method failed: rawmm_weights_do_not_fit: tensors not sent: ['x']")
BROKEN = Exception("Call to collective_rpc method failed: Connection closed by peer [127.0.0.1]:4242")


@pytest.fixture(scope="module")
def other_seed(tiny_qwen2_vl: Path) -> Path:
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model("qwen2_vl", tiny_qwen2_vl.parent / "broadcast_seed1", seed=1)


class TransferClient(ScriptedClient):
    """ScriptedClient with vLLM's weight-transfer methods of ``AsyncLLM``."""

    async def init_weight_transfer_engine(self, request: Any) -> None:
        self._step("init_weight_transfer_engine", request.init_info["rank_offset"])

    async def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        if method != "rawmm_served_dtype":
            return await super().collective_rpc(method, kwargs or {})
        self._step(method)
        return ["bfloat16"]

    async def start_weight_update(self) -> None:
        self._step("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        self._step("update_weights", request.update_info["names"])

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._step("finish_weight_update")


def calls(client: TransferClient) -> list[str]:
    return [name for name, _ in client.calls]


async def test_an_update_pauses_receives_finishes_resets_the_caches_resumes_and_moves_the_version(
    tiny_qwen2_vl: Path,
) -> None:
    client = TransferClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    assert await engine.init_weight_transfer(INIT) == "bfloat16"  # what the worker serves, for the wire
    await engine.start_weight_update()
    await engine.update_weights(UPDATE)
    assert engine.weights_version == 0
    assert await engine.finish_weight_update() == 1
    assert client.calls == [
        ("init_weight_transfer_engine", 1),
        ("rawmm_served_dtype", None),
        ("pause_generation", ("wait", False)),  # vLLM's multimodal caches stay (in step), as for a reload
        ("start_weight_update", None),
        ("update_weights", ["a", "b"]),
        ("finish_weight_update", None),
        ("reset_encoder_cache", None),
        ("reset_prefix_cache", None),
        ("resume_generation", None),
    ]
    await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))


async def test_steps_out_of_order_are_refused(tiny_qwen2_vl: Path) -> None:
    engine = engine_for(TransferClient(tiny_qwen2_vl), tiny_qwen2_vl)
    with pytest.raises(InvalidRequest) as caught:
        await engine.start_weight_update()
    assert caught.value.reason == "weight_transfer_not_initialized"
    await engine.init_weight_transfer(INIT)
    for step, reason in (
        (engine.update_weights(UPDATE), "weight_update_not_started"),
        (engine.finish_weight_update(), "weight_update_not_started"),
    ):
        with pytest.raises(InvalidRequest) as caught:
            await step
        assert caught.value.reason == reason
    await engine.start_weight_update()
    with pytest.raises(InvalidRequest) as caught:
        await engine.start_weight_update()
    assert caught.value.reason == "weight_update_active"


async def test_the_update_waits_for_running_generations(tiny_qwen2_vl: Path) -> None:
    client = TransferClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    await engine.init_weight_transfer(INIT)
    async with engine.gate.generating() as version:
        start = asyncio.ensure_future(engine.start_weight_update())
        await asyncio.sleep(0.2)
        assert not start.done() and "pause_generation" not in calls(client)
    assert version == 0
    await start
    # New generations wait for the finish, and then report the new version.
    generation = asyncio.ensure_future(engine.generate([1, 2, 3], [], Sampling(max_tokens=2)))
    await asyncio.sleep(0.2)
    assert not generation.done()
    await engine.update_weights(UPDATE)
    await engine.finish_weight_update()
    assert (await generation).weights_version == 1


async def test_a_misfit_is_refused_and_the_old_weights_keep_serving(tiny_qwen2_vl: Path) -> None:
    client = TransferClient(tiny_qwen2_vl, fail={"update_weights": MISFIT})
    engine = engine_for(client, tiny_qwen2_vl)
    await engine.init_weight_transfer(INIT)
    await engine.start_weight_update()
    with pytest.raises(InvalidRequest, match="tensors not sent") as caught:
        await engine.update_weights(UPDATE)
    assert caught.value.reason == "weights_do_not_fit"
    with pytest.raises(InvalidRequest) as caught:
        await engine.finish_weight_update()
    assert caught.value.reason == "weight_update_failed"
    # The worker closed its own update with the refusal: no finish for it, no cache reset; vLLM resumes.
    assert calls(client)[-2:] == ["update_weights", "resume_generation"]
    assert engine.weights_version == 0
    await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))


async def test_a_broken_stream_refuses_generation_until_a_checkpoint_loads(
    tiny_qwen2_vl: Path, other_seed: Path
) -> None:
    client = TransferClient(tiny_qwen2_vl, fail={"update_weights": BROKEN})
    engine = engine_for(client, tiny_qwen2_vl)
    await engine.init_weight_transfer(INIT)
    await engine.start_weight_update()
    with pytest.raises(Exception, match="Connection closed"):
        await engine.update_weights(UPDATE)
    with pytest.raises(InvalidRequest, match="broke off"):
        await engine.finish_weight_update()
    assert engine.weights_version == 0
    with pytest.raises(EngineUnavailable, match="reloaded from a checkpoint"):
        await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))
    assert await engine.load_weights(str(other_seed)) == 1
    await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))


async def test_a_failed_reload_after_a_broadcast_does_not_restore_an_older_checkpoint(
    tiny_qwen2_vl: Path, other_seed: Path
) -> None:
    client = TransferClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    await engine.init_weight_transfer(INIT)
    await engine.start_weight_update()
    await engine.update_weights(UPDATE)
    await engine.finish_weight_update()
    client.fail["reload_weights"] = RuntimeError("disk went away")
    with pytest.raises(RuntimeError, match="disk went away"):
        await engine.load_weights(str(other_seed))
    # The served weights were the broadcast's: no checkpoint holds them, so none is "restored".
    assert [arg for name, arg in client.calls if name == "reload_weights"] == [str(other_seed)]
    assert engine.weights_version == 1
    with pytest.raises(EngineUnavailable, match="reloaded from a checkpoint"):
        await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))


async def test_a_new_init_ends_an_abandoned_update_without_moving_the_version(tiny_qwen2_vl: Path) -> None:
    client = TransferClient(tiny_qwen2_vl)
    engine = engine_for(client, tiny_qwen2_vl)
    await engine.init_weight_transfer(INIT)
    await engine.start_weight_update()  # ... and the sender went away before its broadcast
    await engine.init_weight_transfer(INIT)
    assert calls(client)[-4:] == [
        "finish_weight_update",
        "resume_generation",
        "init_weight_transfer_engine",
        "rawmm_served_dtype",
    ]
    assert engine.weights_version == 0
    await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))  # nothing arrived: the weights are whole
    # An update abandoned after its weights arrived leaves weights no version names: stale.
    await engine.start_weight_update()
    await engine.update_weights(UPDATE)
    await engine.init_weight_transfer(INIT)
    assert engine.weights_version == 0
    with pytest.raises(EngineUnavailable, match="abandoned"):
        await engine.generate([1, 2, 3], [], Sampling(max_tokens=2))


def test_the_server_always_takes_broadcasts_and_keeps_the_backend_its_own(tiny_qwen2_vl: Path) -> None:
    from rawmm.serving.vllm_server import WORKER_EXTENSION, VllmArgsError, parse_vllm_args

    def parse(*extra: str) -> Any:
        return parse_vllm_args(model=str(tiny_qwen2_vl), host="127.0.0.1", port=8100, vllm_args=list(extra))

    args = parse("--enforce-eager")
    assert args.weight_transfer_config.backend == "rawmm_gloo"
    assert args.worker_extension_cls == WORKER_EXTENSION
    for extra, named in (
        (["--weight-transfer-config", '{"backend": "nccl"}'], "--weight-transfer-config"),
        (["--worker-extension-cls", "my.Extension"], "--worker-extension-cls"),
    ):
        with pytest.raises(VllmArgsError, match=named):
            parse(*extra)
