"""The orchestrator loop against fake engines, with the real renderer and tokenizer of the tiny model."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import httpx
import pytest
from PIL import Image

from rawmm.config import RunConfig
from rawmm.contract import OffloadStore, parse_ref
from rawmm.contract.shared_dir import (
    CheckpointTimeout,
    SharedDir,
    batch_path,
    checkpoint_dir,
    latest_path,
    latest_step,
)
from rawmm.rl.batches import read_batch, write_batch
from rawmm.rl.envs import Environment, Episode, StepResult, load_environment
from rawmm.rl.orchestrator import loop as loop_module
from rawmm.rl.orchestrator.engine_client import EngineClient, RetryPolicy
from rawmm.rl.orchestrator.loop import AllRolloutsDropped, Orchestrator, episode_seed
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
from rawmm.rl.orchestrator.replicas import ReplicaPool, rendezvous_order
from rawmm.rl.orchestrator.rollout import PromptRenderer, RolloutId, request_seed
from rawmm.rl.samples import RolloutBatch, validate_image_spans


class SayYes(Environment):
    """Text + one image; reward 1 for the reply `yes`. The image depends on the seed only."""

    def episode(self, seed: int) -> Episode:
        return _SayYesEpisode(seed)


class _SayYesEpisode(Episode):
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def start(self):
        image = Image.new("RGB", (56, 56), (self.seed % 256, 10, 10))
        return [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "yes?"}]}
        ]

    def step(self, reply: str) -> StepResult:
        return StepResult(reward=float(reply.strip() == "yes"), done=True)


@pytest.fixture(scope="module")
def renderer_parts(tiny_qwen2_vl):
    from transformers import AutoTokenizer

    return tiny_qwen2_vl, AutoTokenizer.from_pretrained(str(tiny_qwen2_vl))


def make_config(tmp_path: Path, model: Path, urls: list[str], **orchestrator) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model), "preset": "qwen2_vl"},
            "shared_dir": str(tmp_path / "shared"),
            "inference": {"urls": urls},
            "orchestrator": {"prompts_per_step": 2, "rollouts_per_prompt": 2, "max_turns": 3, **orchestrator},
        }
    )


@pytest.fixture
async def orchestrator_factory(tmp_path, renderer_parts):
    model, _ = renderer_parts
    metrics = OrchestratorMetrics()
    pools = []
    async with httpx.AsyncClient(timeout=30) as http:

        def make(
            urls,
            environment: Environment | None = None,
            checkpoint_timeout_s: float = 60.0,
            **orchestrator,
        ) -> Orchestrator:
            config = make_config(tmp_path, model, urls, **orchestrator)
            retry = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01)
            pool = ReplicaPool(urls, EngineClient(http, metrics, retry), metrics)
            pools.append(pool)
            env_cfg = config.orchestrator.environment
            return Orchestrator(
                config,
                pool=pool,
                renderer=PromptRenderer(model, "qwen2_vl", "pil", OffloadStore(config.offload_dir)),
                environment=environment or load_environment(env_cfg.name, env_cfg.args),
                metrics=metrics,
                poll_interval_s=0.02,
                checkpoint_timeout_s=checkpoint_timeout_s,
            )

        yield make, metrics
        for pool in pools:
            await pool.close()


def finish_checkpoint(shared: Path, step: int) -> Path:
    """What the trainer leaves behind: `checkpoints/step_<N>/` and `latest`."""
    checkpoints = SharedDir(shared).checkpoints_dir
    path = checkpoint_dir(checkpoints, step)
    path.mkdir(parents=True, exist_ok=True)
    latest_path(checkpoints).write_text(f"{step}\n")
    return path


def images_of(body) -> list[str]:
    return [parse_ref(ref).raw_image_uri for ref in body["features"]["kwargs_data"]["image"]]


async def test_multiturn_step_carries_every_earlier_image_and_ships_checked_samples(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    engines = [await fake_engines(reply=lambda body: tokenizer.encode("next")) for _ in range(2)]
    make, metrics = orchestrator_factory
    orchestrator = make([e.url for e in engines], environment=None)
    report = await orchestrator.run_step(1)

    batch = read_batch(orchestrator.config.rollouts_dir, 1)
    # Each turn's prompt extends the previous prompt and reply exactly: one sample per rollout, 3 turns each.
    assert (batch.step, len(batch.samples), report.rollouts, report.samples) == (1, 4, 4, 4)
    assert report.images_sent == 4 * (1 + 2 + 3)
    by_turn = {}
    for sample in batch.samples:
        validate_image_spans(sample.mm_refs, sample.mm_token_type_ids)
        assert sample.sample_id.endswith("-t0")
        assert len(sample.mm_refs) == 3  # every turn's image, once
        completion = [i for i, on in enumerate(sample.loss_mask) if on]
        assert [sample.token_ids[i] for i in completion] == tokenizer.encode("next") * 3
        assert completion[-1] == len(sample) - 1
        assert all(sample.logprobs[i] == -0.5 for i in completion)
        by_turn[sample.sample_id.rsplit("-t", 1)[0]] = [sample]
    first_images = {sid: samples[0].mm_refs[0].uri for sid, samples in by_turn.items()}
    assert first_images["step1-g0-r0"] == first_images["step1-g0-r1"]  # a group shares its task
    assert first_images["step1-g0-r0"] != first_images["step1-g1-r0"]

    bodies = [b for e in engines for b in e.generate_bodies]
    assert len(bodies) == 12
    assert all(len(images_of(b)) == len(b["features"]["mm_hashes"]["image"]) for b in bodies)
    assert metrics.registry.get_sample_value("rawmm_rollouts_total") == 4
    assert metrics.registry.get_sample_value("rawmm_orchestrator_step") == 1


async def test_every_turn_of_a_rollout_is_served_by_its_pinned_replica(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    engines = [await fake_engines(reply=lambda body: tokenizer.encode("zoom")) for _ in range(3)]
    make, _ = orchestrator_factory
    orchestrator = make([e.url for e in engines], prompts_per_step=3, rollouts_per_prompt=3)
    await orchestrator.run_step(1)
    seeds_at = {e.url: {b["sampling"]["seed"] for b in e.generate_bodies} for e in engines}
    urls = [e.url for e in engines]
    for group in range(3):
        for index in range(3):
            rollout = RolloutId(1, group, index)
            pinned = rendezvous_order(str(rollout), urls)[0]
            for turn in range(3):
                assert request_seed(0, rollout, turn) in seeds_at[pinned]
    assert sum(1 for seeds in seeds_at.values() if seeds) >= 2  # the rollouts spread over replicas


async def test_rewards_become_group_normalized_advantages(fake_engines, orchestrator_factory, renderer_parts):
    _, tokenizer = renderer_parts
    # Even sampling seeds say yes, odd ones no: groups get mixed rewards.
    engine = await fake_engines(
        reply=lambda body: tokenizer.encode("yes" if body["sampling"]["seed"] % 2 == 0 else "no")
    )
    make, metrics = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes(), prompts_per_step=3, rollouts_per_prompt=4)
    report = await orchestrator.run_step(1)
    samples = read_batch(orchestrator.config.rollouts_dir, 1).samples
    expected_reward = {}
    for group in range(3):
        rewards = [float(request_seed(0, RolloutId(1, group, i), 0) % 2 == 0) for i in range(4)]
        # worked out independently of the code under test: (r - mean) / (population std + eps)
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for i, reward in enumerate(rewards):
            expected_reward[f"step1-g{group}-r{i}-t0"] = (reward, (reward - mean) / (std + 1e-6))
    assert len(samples) == 12
    for sample in samples:
        reward, advantage = expected_reward[sample.sample_id]
        assert sample.reward == reward
        trained = [a for a, on in zip(sample.advantages, sample.loss_mask, strict=True) if on]
        assert trained and trained == pytest.approx([advantage] * len(trained))
        assert not any(a for a, on in zip(sample.advantages, sample.loss_mask, strict=True) if not on)
    assert report.reward_mean == pytest.approx(sum(r for r, _ in expected_reward.values()) / 12)
    assert metrics.registry.get_sample_value("rawmm_reward_mean") == pytest.approx(report.reward_mean)


async def test_the_step_reports_the_score_per_answer_and_the_weight_sync_time(
    fake_engines, orchestrator_factory, renderer_parts
):
    from rawmm.rl.envs import ColoursEnvironment

    _, tokenizer = renderer_parts
    engine = await fake_engines(reply=lambda body: tokenizer.encode(" red"))
    make, _ = orchestrator_factory
    environment = ColoursEnvironment(colours=4)
    orchestrator = make([engine.url], environment=environment, prompts_per_step=6, rollouts_per_prompt=2)
    report = await orchestrator.run_step(1)
    asked = {environment.episode(episode_seed(0, 1, g)).answers[0] for g in range(6)}
    # Always answering red: right on every red image, wrong on every other.
    assert report.reward_by_label == {label: float(label == "red") for label in asked}
    assert report.sync_seconds >= 0.0


async def test_invalid_ref_drops_just_that_rollout_and_counts_it(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    rejected = RolloutId(1, 0, 1)
    engine = await fake_engines(
        reply=lambda body: tokenizer.encode("yes"),
        reject=lambda body: (
            "hash_mismatch" if body["sampling"]["seed"] == request_seed(0, rejected, 0) else None
        ),
    )
    make, metrics = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes())
    report = await orchestrator.run_step(1)
    ids = {s.sample_id for s in read_batch(orchestrator.config.rollouts_dir, 1).samples}
    assert ids == {"step1-g0-r0-t0", "step1-g1-r0-t0", "step1-g1-r1-t0"}
    assert report.dropped == {"invalid_mm_image_ref": 1}
    assert len(engine.generate_bodies) == 4  # dropped at once, never retried
    assert (
        metrics.registry.get_sample_value("rawmm_samples_dropped_total", {"reason": "invalid_mm_image_ref"})
        == 1
    )


async def test_a_step_with_every_rollout_rejected_fails_and_writes_nothing(
    fake_engines, orchestrator_factory
):
    engine = await fake_engines(reject=lambda body: "missing_file")
    make, _ = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes())
    with pytest.raises(AllRolloutsDropped, match="all rollouts were dropped"):
        await orchestrator.run_step(1)
    assert not batch_path(orchestrator.config.rollouts_dir, 1).exists()


async def test_waits_for_the_trainer_then_loads_its_checkpoint_before_sampling(
    fake_engines, orchestrator_factory, renderer_parts, monkeypatch
):
    _, tokenizer = renderer_parts
    checkpoints: list[Path] = []
    steps_seen_by_generate: list[int] = []

    def reply(body):
        steps_seen_by_generate.append(latest_step(checkpoints[0]))  # the trainer's newest checkpoint then
        return tokenizer.encode("yes")

    engine = await fake_engines(reply=reply)
    make, metrics = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes(), max_async_level=1)
    shared = orchestrator.config.shared_dir
    checkpoints.append(orchestrator.config.checkpoints_dir)
    waiting = asyncio.Event()
    wait_for_checkpoint = loop_module.wait_for_checkpoint

    async def entered(*args, **kwargs):
        waiting.set()
        return await wait_for_checkpoint(*args, **kwargs)

    monkeypatch.setattr(loop_module, "wait_for_checkpoint", entered)
    task = asyncio.create_task(orchestrator.run_step(2))
    await asyncio.wait_for(waiting.wait(), timeout=30)
    assert engine.calls == []  # the step waits for the trainer before it asks anything of an engine
    checkpoint = finish_checkpoint(shared, 1)  # only now: the step was waiting for it
    report = await asyncio.wait_for(task, timeout=30)
    assert steps_seen_by_generate == [1] * 4  # nothing was sampled before checkpoint 1 existed
    assert engine.weights_paths == [str(checkpoint.resolve())]
    assert report.weights_step == 1 and engine.calls == ["weights"] + ["generate"] * 4
    assert metrics.registry.get_sample_value("rawmm_orchestrator_weights_step") == 1


async def test_a_checkpoint_that_never_comes_fails_the_step_after_its_deadline(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    engine = await fake_engines(reply=lambda body: tokenizer.encode("yes"))
    make, _ = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes(), max_async_level=1, checkpoint_timeout_s=0.2)
    with pytest.raises(CheckpointTimeout, match="no trainer checkpoint for step 1"):
        await asyncio.wait_for(orchestrator.run_step(2), timeout=30)
    assert engine.generate_bodies == []


async def test_run_resumes_after_the_last_batch_and_ends_on_the_final_weights(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    engine = await fake_engines(reply=lambda body: tokenizer.encode("yes"))
    make, _ = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes(), max_async_level=1)
    shared = orchestrator.config.shared_dir
    write_batch(orchestrator.config.rollouts_dir, RolloutBatch(step=1, samples=[]))  # from before a restart
    finish_checkpoint(shared, 1)

    async def trainer() -> None:
        # Stands in for the trainer: checkpoint step 2 as soon as its batch appears.
        while not batch_path(orchestrator.config.rollouts_dir, 2).exists():
            await asyncio.sleep(0.02)
        finish_checkpoint(shared, 2)

    fake_trainer = asyncio.create_task(trainer())
    reports = await asyncio.wait_for(orchestrator.run(2), timeout=30)
    await fake_trainer
    assert [r.step for r in reports] == [2]
    assert [Path(p).name for p in engine.weights_paths] == ["step_1", "step_2"]
    assert orchestrator.pool.weights_versions == {engine.url: 2}


async def test_a_sampled_image_placeholder_token_never_reaches_a_training_sample(
    fake_engines, orchestrator_factory, renderer_parts
):
    _, tokenizer = renderer_parts
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    yes = tokenizer.encode("yes")
    # Rollout 0 of each group: "yes", then a placeholder, then more; rollout 1 starts with one.
    engine = await fake_engines(
        reply=lambda body: [*yes, pad, *yes] if body["sampling"]["seed"] % 2 == 0 else [pad, *yes]
    )
    make, _ = orchestrator_factory
    orchestrator = make([engine.url], environment=SayYes(), prompts_per_step=4)
    await orchestrator.run_step(1)
    samples = read_batch(orchestrator.config.rollouts_dir, 1).samples
    seeds = {
        f"step1-g{g}-r{r}-t0": request_seed(0, RolloutId(1, g, r), 0) for g in range(4) for r in range(2)
    }
    assert {s.sample_id for s in samples} == {sid for sid, seed in seeds.items() if seed % 2 == 0}
    for sample in samples:
        completion = [t for t, on in zip(sample.token_ids, sample.loss_mask, strict=True) if on]
        assert completion == yes
        assert sample.token_ids.count(pad) == sum(image.length for image in sample.mm_refs)


@pytest.mark.parametrize(("every", "expected"), [(1, (False, None)), (3, (True, "step_2"))])
def test_a_replica_that_missed_updates_waits_for_the_weights_checkpoint_only_when_one_comes_at_once(
    tmp_path: Path, every: int, expected: tuple[bool, str | None]
) -> None:
    """Broadcast mode, the replicas on step 3's weights, the latest checkpoint step 2's. Writing one every step,
    the trainer is writing step 3's now: a restarted replica waits for it. Writing one every 3 steps, step 3's
    comes with the next step, which needs rollouts: the replica serves step 2's until that next update."""
    from types import SimpleNamespace

    config = RunConfig.model_validate(
        {
            "model": {"path": "m", "preset": "qwen2_vl"},
            "shared_dir": str(tmp_path / "shared"),
            "trainer": {"weight_transfer": "broadcast", "checkpoint_every": every},
        }
    )
    finish_checkpoint(config.shared_dir, 2)
    config.weights_step_path.write_text("3\n")
    pool = SimpleNamespace(catch_up=None)
    Orchestrator(
        config, pool=pool, renderer=None, environment=None, metrics=OrchestratorMetrics(),  # type: ignore[arg-type]
        checkpoint_timeout_s=5,
    )  # fmt: skip
    ready, path = pool.catch_up()
    assert (ready, path and Path(path).name) == expected
