"""With `trainer.weight_transfer: broadcast`, a replica that missed an update catches up from the latest
checkpoint before it serves again, and a restarted trainer sends nothing for the steps it trains again: two
real transformers replicas, the trainer's end of the broadcast (`WeightPublisher`) and the orchestrator's
replica pool, with one replica restarted between updates, then the trainer."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ports import free_port

from rawmm.config import RunConfig
from rawmm.contract.engine_api import GENERATE_PATH, GenerateRequest, Sampling
from rawmm.contract.shared_dir import checkpoint_dir, latest_path
from rawmm.rl.orchestrator.engine_client import EngineClient, RetryPolicy
from rawmm.rl.orchestrator.loop import Orchestrator, weights_step
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
from rawmm.rl.orchestrator.replicas import ReplicaPool
from rawmm.rl.trainer.distributed import DistContext
from rawmm.rl.trainer.weight_publish import WeightPublisher

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from serve_harness import WEIGHTS_TOKEN, serve_process  # noqa: E402

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = Sampling(max_tokens=8, temperature=1.0, top_p=1.0, seed=3, logprobs=True)


@contextmanager
def replica(model: Path, checkpoints: Path, port: int, log: Path) -> Iterator[str]:
    """`rawmm serve` of `model` on `port`, taking weights from `checkpoints` (the run's)."""
    url = f"http://127.0.0.1:{port}"
    (offload := log.parent / "offload").mkdir(exist_ok=True)
    command = [
        sys.executable, "-m", "rawmm.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--offload-root", str(offload), "--weights-root", str(checkpoints),
        "--engine", "transformers", "--materialize-cache-size", "0",
    ]  # fmt: skip
    env = {**os.environ, "RAWMM_WEIGHTS_TOKEN": WEIGHTS_TOKEN}
    with serve_process(command, env, log, url, 240.0):
        yield url


def generate(url: str) -> tuple[list[int], list[float], int]:
    body = {"prompt_token_ids": PROMPT, "sampling": SAMPLING.model_dump()}
    answer = httpx.post(f"{url}{GENERATE_PATH}", json=body, timeout=300.0).json()
    return answer["token_ids"], answer["logprobs"], answer["weights_version"]


def train(model: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def one_rank_publisher(model: Any, urls: list[str], config: RunConfig) -> WeightPublisher:
    """A one-rank trainer's end of the broadcast to `urls`, in small buckets."""
    return WeightPublisher(
        model,
        urls,
        DistContext(rank=0, world_size=1, device=torch.device("cpu")),
        sharded=False,
        weights_step_path=config.weights_step_path,
        bucket_bytes=256 * 1024,
        timeout_s=60.0,
    )


def checkpoint(model: Any, base: Path, checkpoints: Path, step: int) -> Path:
    """What the trainer publishes after a step: `step_<N>/` (a from_pretrained dir), then `latest`."""
    path = checkpoint_dir(checkpoints, step)
    shutil.copytree(base, path)
    model.save_pretrained(path, safe_serialization=True)
    latest_path(checkpoints).write_text(f"{step}\n")
    return path


@pytest.mark.slow
def test_a_replica_that_missed_updates_catches_up_from_the_checkpoint_before_it_serves(
    tiny_qwen2_vl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForImageTextToText

    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    config = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_qwen2_vl), "preset": "qwen2_vl"},
            "shared_dir": str(tmp_path / "shared"),
            "trainer": {"weight_transfer": "broadcast"},
        }
    )
    checkpoints = config.checkpoints_dir
    checkpoints.mkdir(parents=True)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32)
    ports = [free_port(), free_port()]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()

    with ExitStack() as stack:
        a = stack.enter_context(replica(tiny_qwen2_vl, checkpoints, ports[0], tmp_path / "a" / "serve.log"))
        b_process = ExitStack()
        b = b_process.enter_context(replica(tiny_qwen2_vl, checkpoints, ports[1], tmp_path / "b" / "1.log"))
        stack.callback(b_process.close)
        publisher = one_rank_publisher(model, [a, b], config)
        stack.callback(publisher.shutdown)

        # Step 1: both replicas up, the weights go by broadcast; weights_step moves before the checkpoint.
        train(model, seed=1)
        sent = publisher.send(1)
        assert (sent.delivery, sent.versions) == ("broadcast", {a: 1, b: 1})
        assert weights_step(config) == 1 and not checkpoint_dir(checkpoints, 1).exists()
        step_1 = checkpoint(model, tiny_qwen2_vl, checkpoints, 1)
        assert publisher.after_checkpoint(1, step_1, sent) == sent  # nothing to reload
        served_1 = generate(a)
        assert generate(b) == served_1

        # b restarts: it serves the base weights (version 0), outside the broadcast group.
        b_process.close()
        b_process = ExitStack()
        b_process.enter_context(replica(tiny_qwen2_vl, checkpoints, ports[1], tmp_path / "b" / "2.log"))
        assert generate(b)[2] == 0 and generate(b)[:2] != served_1[:2]

        # The orchestrator's pool sees it answer below the version it saw, drops that generation, and
        # revives it from the latest checkpoint before it serves again.
        async def orchestrate() -> tuple[str, tuple[list[int], list[float], int]]:
            metrics = OrchestratorMetrics()
            async with httpx.AsyncClient(timeout=300) as http:
                client = EngineClient(http, metrics, RetryPolicy(attempts=2, initial_backoff_s=0.05))
                pool = ReplicaPool([a, b], client, metrics, probe_interval_s=0.1, down_timeout_s=120)
                Orchestrator(
                    config, pool=pool, renderer=None, environment=None, metrics=metrics,  # type: ignore[arg-type]
                    checkpoint_timeout_s=5,
                )  # fmt: skip
                pool.weights_versions.update({a: 1, b: 1})  # what the generations of step 1 showed it
                key = next(f"rollout-{i}" for i in range(100) if pool_first(pool, f"rollout-{i}") == b)
                request = GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING)
                url, generation = await pool.generate(key, request)
                assert url == a  # b's stale answer was dropped and b marked down
                for _ in range(600):
                    if b in pool.up:
                        break
                    await asyncio.sleep(0.1)
                assert b in pool.up, "b never came back"
                url, generation = await pool.generate(key, request)
                await pool.close()
                return url, (generation.token_ids, generation.logprobs or [], generation.weights_version)

        url, caught_up = asyncio.run(orchestrate())
        assert url == b
        assert caught_up[:2] == served_1[:2] and caught_up[2] == 1  # step 1's weights, by checkpoint

        # Step 2: b is not in the group: the broadcast fails on it, and every replica loads the checkpoint.
        train(model, seed=2)
        sent = publisher.send(2)
        assert sent.delivery == "reload" and weights_step(config) == 1
        step_2 = checkpoint(model, tiny_qwen2_vl, checkpoints, 2)
        reloaded = publisher.after_checkpoint(2, step_2, sent)
        assert reloaded.delivery == "reload" and set(reloaded.versions) == {a, b}
        assert weights_step(config) == 2
        served_2 = generate(a)
        assert generate(b)[:2] == served_2[:2] != served_1[:2]

        # Step 3: the group is built again with both, and the broadcast is back.
        train(model, seed=3)
        sent = publisher.send(3)
        assert sent.delivery == "broadcast" and set(sent.versions) == {a, b}
        step_3 = checkpoint(model, tiny_qwen2_vl, checkpoints, 3)
        served_3 = generate(a)
        assert generate(b)[:2] == served_3[:2]
        assert (
            httpx.post(
                f"{a}/v1/rawmm/weights",
                json={"path": str(step_3)},
                headers={"Authorization": f"Bearer {WEIGHTS_TOKEN}"},
            ).status_code
            == 200
        )
        assert generate(a)[:2] == served_3[:2]  # the broadcast weights are the checkpoint's, bit for bit

        # The trainer restarts from step 2's checkpoint and trains step 3 again (the bits of a replay may
        # differ: another seed here). The replicas hold step 3's weights already: nothing is sent, no
        # version or weights_step moves back; step 4 goes to both by broadcast.
        publisher.shutdown()
        restarted = one_rank_publisher(model, [a, b], config)
        stack.callback(restarted.shutdown)
        before = [generate(a), generate(b)]
        train(model, seed=30)
        held = restarted.send(3)
        assert held.delivery == "held" and restarted.sender is None  # no group was even built
        assert weights_step(config) == 3 and [generate(a), generate(b)] == before
        train(model, seed=4)
        sent = restarted.send(4)
        assert sent.delivery == "broadcast" and set(sent.versions) == {a, b} and weights_step(config) == 4
        assert generate(a)[:2] == generate(b)[:2] != before[0][:2]


def pool_first(pool: ReplicaPool, key: str) -> str:
    from rawmm.rl.orchestrator.replicas import rendezvous_order

    return rendezvous_order(key, pool.urls)[0]
