from __future__ import annotations

from typing import Any

import httpx
import pytest

from rawmm.contract.engine_api import GenerateRequest, Sampling
from rawmm.rl.orchestrator.engine_client import (
    EngineClient,
    InvalidRefError,
    ReplicaUnavailable,
    RequestRejected,
    RetryPolicy,
)
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics

FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
SAMPLING = Sampling(max_tokens=4, temperature=1.0, top_p=1.0, seed=0, logprobs=True)


def request(prompt_token_ids: list[int], features: dict[str, Any] | None = None) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt_token_ids, features=features, sampling=SAMPLING)


def error_count(metrics: OrchestratorMetrics, kind: str) -> float:
    return metrics.registry.get_sample_value("rawmm_engine_request_errors_total", {"kind": kind}) or 0.0


@pytest.fixture
async def client_and_metrics():
    metrics = OrchestratorMetrics()
    async with httpx.AsyncClient(timeout=5) as http:
        yield EngineClient(http, metrics, FAST_RETRY), metrics


async def test_5xx_is_retried_until_it_succeeds(fake_engines, client_and_metrics):
    client, metrics = client_and_metrics
    engine = await fake_engines(fail_next=2)
    generation = await client.generate(engine.url, request([1, 2]))
    assert generation.token_ids == [5, 6, 7]
    assert len(engine.generate_bodies) == 3
    assert error_count(metrics, "server_error") == 2


async def test_persistent_5xx_gives_up_after_the_policy_attempts(fake_engines, client_and_metrics):
    client, metrics = client_and_metrics
    engine = await fake_engines(fail_next=100)
    with pytest.raises(ReplicaUnavailable, match="3 attempts"):
        await client.generate(engine.url, request([1]))
    assert len(engine.generate_bodies) == FAST_RETRY.attempts


async def test_down_replica_is_reported_as_unreachable(fake_engines, client_and_metrics):
    client, metrics = client_and_metrics
    engine = await fake_engines()
    await engine.stop()
    with pytest.raises(ReplicaUnavailable, match=engine.url):
        await client.generate(engine.url, request([1]))
    assert error_count(metrics, "unreachable") == FAST_RETRY.attempts


async def test_invalid_ref_is_not_retried(fake_engines, client_and_metrics):
    client, metrics = client_and_metrics
    engine = await fake_engines(reject=lambda body: "missing_file")
    with pytest.raises(InvalidRefError) as info:
        await client.generate(engine.url, request([1]))
    assert info.value.reason == "missing_file"
    assert len(engine.generate_bodies) == 1
    assert error_count(metrics, "invalid_ref") == 1


async def test_request_body_carries_prompt_features_and_sampling(fake_engines, client_and_metrics):
    client, _ = client_and_metrics
    engine = await fake_engines()
    features = {"mm_hashes": {"image": ["a" * 32]}}
    await client.generate(engine.url, request([1, 2, 3], features))
    assert engine.generate_bodies == [
        {
            "prompt_token_ids": [1, 2, 3],
            "features": features,
            "sampling": {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 0, "logprobs": True},
        }
    ]


async def test_mismatched_logprobs_are_a_bad_response():
    # A response whose logprobs do not line up with its tokens must not become a training sample.
    metrics = OrchestratorMetrics()

    class Lying(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = {"token_ids": [1, 2], "logprobs": [-1.0], "finish_reason": "stop", "weights_version": 0}
            return httpx.Response(200, json=body)

    async with httpx.AsyncClient(transport=Lying()) as http:
        with pytest.raises(RequestRejected, match="1 logprobs for 2 tokens"):
            await EngineClient(http, metrics, FAST_RETRY).generate("http://x", request([1]))
    assert error_count(metrics, "bad_response") == 1


async def test_load_weights_and_health_report_the_version(fake_engines, client_and_metrics):
    client, _ = client_and_metrics
    engine = await fake_engines()
    assert await client.health(engine.url) == 0
    assert await client.load_weights(engine.url, "/ckpt/step_1") == 1
    assert await client.health(engine.url) == 1
    assert engine.weights_paths == ["/ckpt/step_1"]


def test_backoff_grows_exponentially_and_is_capped():
    policy = RetryPolicy(attempts=6, initial_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_weight_updates_carry_the_run_token_and_generations_do_not(monkeypatch):
    from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV

    seen: dict[str, str | None] = {}

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen[request.url.path] = request.headers.get("authorization")
            if request.url.path.endswith("/weights"):
                return httpx.Response(200, json={"weights_version": 1})
            body = {"token_ids": [1], "logprobs": [-1.0], "finish_reason": "stop", "weights_version": 1}
            return httpx.Response(200, json=body)

    monkeypatch.setenv(WEIGHTS_TOKEN_ENV, "s3cret")
    async with httpx.AsyncClient(transport=Recording()) as http:
        client = EngineClient(http, OrchestratorMetrics(), FAST_RETRY)
        assert await client.load_weights("http://x", "/ckpt/step_1") == 1
        await client.generate("http://x", request([1]))
    assert seen == {"/v1/rawmm/weights": "Bearer s3cret", "/v1/rawmm/generate": None}
