from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from rawmm.contract.engine_api import GenerateRequest, Sampling
from rawmm.rl.orchestrator.engine_client import EngineClient, RetryPolicy
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
from rawmm.rl.orchestrator.replicas import NoReplicaAvailable, ReplicaPool, rendezvous_order

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01)
SAMPLING = Sampling(max_tokens=4, temperature=1.0, top_p=1.0, seed=0, logprobs=True)


def request(prompt_token_ids: list[int]) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt_token_ids, sampling=SAMPLING)


def test_rendezvous_order_is_stable_and_spreads_keys():
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    firsts = Counter(rendezvous_order(f"rollout-{k}", urls)[0] for k in range(400))
    assert rendezvous_order("rollout-7", urls) == rendezvous_order("rollout-7", list(reversed(urls)))
    assert set(firsts) == set(urls) and min(firsts.values()) > 60


def test_rendezvous_order_is_the_same_in_a_fresh_process_with_another_hash_seed():
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    keys = [f"step{k}-g{k % 3}-r{k % 2}" for k in range(50)]
    script = (
        "import json, sys\n"
        "from rawmm.rl.orchestrator.replicas import rendezvous_order\n"
        "keys, urls = json.loads(sys.argv[1])\n"
        "print(json.dumps([rendezvous_order(k, urls) for k in keys]))\n"
    )
    here = [rendezvous_order(k, urls) for k in keys]
    # Two seeds, so at least one differs from this process's (which may be fixed or random).
    for hash_seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps([keys, urls])],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(done.stdout) == here, hash_seed


def test_removing_a_replica_moves_only_its_keys():
    urls = [f"http://e{i}" for i in range(3)]
    keys = [f"k{i}" for i in range(200)]
    before = {k: rendezvous_order(k, urls)[0] for k in keys}
    after = {k: rendezvous_order(k, urls[:2])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == urls[2]}


@pytest.fixture
async def pool_factory():
    metrics = OrchestratorMetrics()
    pools: list[ReplicaPool] = []
    async with httpx.AsyncClient(timeout=5) as http:

        def make(urls, **kwargs) -> ReplicaPool:
            pool = ReplicaPool(urls, EngineClient(http, metrics, FAST_RETRY), metrics, **kwargs)
            pools.append(pool)
            return pool

        yield make, metrics
        for pool in pools:
            await pool.close()


async def test_every_turn_of_a_rollout_goes_to_its_pinned_replica(fake_engines, pool_factory):
    make, _ = pool_factory
    engines = [await fake_engines() for _ in range(3)]
    pool = make([e.url for e in engines])
    for key in ("s1-g0-r0", "s1-g0-r1", "s1-g1-r0"):
        answered = {(await pool.generate(key, request([1])))[0] for _ in range(3)}
        assert answered == {rendezvous_order(key, pool.urls)[0]}


async def test_down_replica_fails_over_and_is_reported(fake_engines, pool_factory):
    make, metrics = pool_factory
    engines = [await fake_engines() for _ in range(2)]
    pool = make([e.url for e in engines], probe_interval_s=60)
    key = "rollout"
    pinned = next(e for e in engines if e.url == rendezvous_order(key, pool.urls)[0])
    other = next(e for e in engines if e is not pinned)
    await pinned.stop()
    url, generation = await pool.generate(key, request([1]))
    assert url == other.url and generation.token_ids == [5, 6, 7]
    assert pool.up == [other.url]
    assert metrics.registry.get_sample_value("rawmm_engine_replicas_up") == 1
    assert (
        metrics.registry.get_sample_value("rawmm_engine_request_errors_total", {"kind": "unreachable"}) == 2
    )


async def test_replica_back_from_down_loads_the_latest_weights_first(fake_engines, pool_factory):
    make, metrics = pool_factory
    engines = [await fake_engines() for _ in range(2)]
    pool = make([e.url for e in engines], probe_interval_s=0.02)
    await pool.load_weights("/ckpt/step_1")
    victim = engines[0]
    await victim.stop()
    await pool.load_weights("/ckpt/step_2")  # the victim misses this one
    assert pool.up == [engines[1].url]
    await victim.start()  # same port: the replica restarted, weights as loaded
    victim.weights_version = 0
    await asyncio.wait_for(_until(lambda: victim.url in pool.up), timeout=10)
    assert victim.weights_paths[-1] == "/ckpt/step_2"
    assert pool.weights_versions[victim.url] == victim.weights_version
    assert metrics.registry.get_sample_value("rawmm_engine_replicas_up") == 2


async def test_a_replica_that_restarted_unseen_is_not_used_until_it_has_the_latest_weights(
    fake_engines, pool_factory
):
    make, _ = pool_factory
    engines = [await fake_engines() for _ in range(2)]
    pool = make([e.url for e in engines], probe_interval_s=0.02)
    await pool.load_weights("/ckpt/step_1")
    key = "rollout"
    pinned = next(e for e in engines if e.url == rendezvous_order(key, pool.urls)[0])
    other = next(e for e in engines if e is not pinned)
    pinned.weights_version = 0  # restarted between two requests: up again, on its startup weights
    url, generation = await pool.generate(key, request([1]))
    assert (url, generation.weights_version) == (other.url, 1)  # not the stale replica's answer
    await asyncio.wait_for(_until(lambda: pinned.url in pool.up), timeout=10)
    assert pinned.weights_paths == ["/ckpt/step_1", "/ckpt/step_1"]  # reloaded before it serves again
    url, generation = await pool.generate(key, request([1]))
    assert (url, generation.weights_version) == (pinned.url, 1)


async def test_all_replicas_down_waits_then_fails_clearly(fake_engines, pool_factory):
    make, _ = pool_factory
    engine = await fake_engines()
    pool = make([engine.url], down_timeout_s=0.3, probe_interval_s=0.05)
    await engine.stop()
    with pytest.raises(NoReplicaAvailable, match="no engine replica answered"):
        await asyncio.wait_for(pool.generate("k", request([1])), timeout=10)


async def test_all_replicas_down_then_one_returns_resumes_the_rollout(fake_engines, pool_factory):
    make, _ = pool_factory
    engine = await fake_engines()
    pool = make([engine.url], down_timeout_s=30, probe_interval_s=0.02)
    await engine.stop()
    pending = asyncio.create_task(pool.generate("k", request([1])))
    await asyncio.wait_for(_until(lambda: not pool.up), timeout=10)
    assert not pending.done()
    await engine.start()
    url, generation = await asyncio.wait_for(pending, timeout=10)
    assert url == engine.url and generation.token_ids == [5, 6, 7]


async def test_load_weights_reaches_every_live_replica(fake_engines, pool_factory):
    make, _ = pool_factory
    engines = [await fake_engines() for _ in range(3)]
    pool = make([e.url for e in engines])
    await pool.load_weights("/ckpt/step_3")
    assert [e.weights_paths for e in engines] == [["/ckpt/step_3"]] * 3
    assert pool.weights_versions == {e.url: 1 for e in engines}


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


class HealthRecordingClient(EngineClient):
    """Records every `/health` probe that failed, so a test can act only after the pool has seen one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed_health: list[str] = []

    async def health(self, url: str) -> int:
        try:
            return await super().health(url)
        except httpx.HTTPError:
            self.failed_health.append(url)
            raise


async def test_wait_ready_waits_for_a_replica_that_is_still_starting(fake_engines):
    engine = await fake_engines()
    await engine.stop()  # not listening yet: still loading its model
    metrics = OrchestratorMetrics()
    async with httpx.AsyncClient(timeout=5) as http:
        client = HealthRecordingClient(http, metrics, FAST_RETRY)
        pool = ReplicaPool([engine.url], client, metrics, down_timeout_s=30, probe_interval_s=0.02)
        waiting = asyncio.create_task(pool.wait_ready())
        try:
            # The engine comes up only once the pool found it down: wait_ready has to probe again.
            await asyncio.wait_for(_until(lambda: client.failed_health or waiting.done()), timeout=10)
            assert not waiting.done(), waiting  # it gave up instead of probing again
            await engine.start()
            await asyncio.wait_for(waiting, timeout=10)
        finally:
            waiting.cancel()
            await pool.close()
    assert pool.up == [engine.url]


async def test_wait_ready_goes_on_with_the_replicas_that_came_up(fake_engines, pool_factory):
    make, metrics = pool_factory
    up, never = await fake_engines(), await fake_engines()
    await never.stop()
    pool = make([up.url, never.url], down_timeout_s=0.2, probe_interval_s=0.02)
    await asyncio.wait_for(pool.wait_ready(), timeout=10)
    assert pool.up == [up.url]
    assert metrics.registry.get_sample_value("rawmm_engine_replicas_up") == 1


async def test_wait_ready_fails_clearly_when_no_replica_comes_up(fake_engines, pool_factory):
    make, _ = pool_factory
    engine = await fake_engines()
    await engine.stop()
    pool = make([engine.url], down_timeout_s=0.2, probe_interval_s=0.02)
    with pytest.raises(NoReplicaAvailable, match="no engine replica became healthy within 0s"):
        await asyncio.wait_for(pool.wait_ready(), timeout=10)
