"""The orchestrator loop: per step, wait for the trainer, sync weights, play the rollouts, ship a batch.

Step N (1-based, like the trainer's checkpoints) starts once the trainer's latest checkpoint is at
least N - max_async_level; before its rollouts every live replica is told to load that checkpoint.
A step's `prompts_per_step` groups of `rollouts_per_prompt` rollouts run concurrently; each group
shares one episode seed (the same task and images), its rewards are normalized within the group,
and every turn of every surviving rollout becomes a sample. A rollout the engine rejects (invalid
image ref, or any other 4xx) is dropped and counted, never retried. After the last batch the
orchestrator waits for the final checkpoint and has the replicas load it, so a finished run's
engines serve its final weights.

With `trainer.weight_transfer: broadcast` the trainer puts each step's weights into the replicas itself
and then moves `checkpoints/weights_step` (`RunConfig.weights_step_path`): the orchestrator waits on that
instead of `latest`, tells no replica to load anything, and a replica that missed an update (it
restarted: it is down, or answers on an older weights version) loads the latest checkpoint before it
serves again, once that checkpoint has caught up with `weights_step`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rawmm.config import RunConfig
from rawmm.contract.engine_api import Sampling
from rawmm.contract.shared_dir import (
    CheckpointTimeout,
    checkpoint_dir,
    latest_step,
    read_step,
    wait_for_checkpoint,
    written_steps,
)
from rawmm.rl.batches import write_batch
from rawmm.rl.envs import Environment
from rawmm.rl.orchestrator.advantages import group_advantages
from rawmm.rl.orchestrator.engine_client import InvalidRefError, RequestRejected
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
from rawmm.rl.orchestrator.replicas import ReplicaPool
from rawmm.rl.orchestrator.rollout import PromptRenderer, Rollout, RolloutId, branch_samples, play
from rawmm.rl.samples import RolloutBatch, Sample

log = logging.getLogger(__name__)


class AllRolloutsDropped(RuntimeError):
    """Every rollout of a step was rejected; training on nothing would hide the problem."""


@dataclass(frozen=True)
class StepReport:
    """What one step did; printed as one JSON line (`rawmm run` and log collectors read it)."""

    step: int
    weights_step: int
    rollouts: int
    dropped: dict[str, int]
    samples: int
    reward_mean: float
    images_sent: int
    rollout_seconds: float
    wait_seconds: float
    # telling the replicas to load the newest checkpoint, until every one answered (0 when the trainer
    # broadcasts the weights itself)
    sync_seconds: float
    # Mean score per answer label over the step's scored replies (`Episode.outcomes`); empty when the
    # environment reports none. Shows which answers a policy gets right, not only how many.
    reward_by_label: dict[str, float]

    def log_line(self) -> str:
        return json.dumps({"event": "orchestrator_step", **self.__dict__}, sort_keys=True)


class Orchestrator:
    def __init__(
        self,
        config: RunConfig,
        *,
        pool: ReplicaPool,
        renderer: PromptRenderer,
        environment: Environment,
        metrics: OrchestratorMetrics,
        checkpoint_timeout_s: float,
        poll_interval_s: float = 0.2,
    ) -> None:
        self.config, self.pool, self.renderer = config, pool, renderer
        self.environment, self.metrics = environment, metrics
        self._poll_interval_s = poll_interval_s
        self._checkpoint_timeout_s = checkpoint_timeout_s  # per wait
        self.weights_step = 0  # the checkpoint the replicas were last told to load (0 = as started)
        self.broadcast = config.trainer.weight_transfer == "broadcast"
        if self.broadcast:
            pool.catch_up = self._catch_up

    async def run(
        self, steps: int, *, on_step: Callable[[StepReport], None] | None = None
    ) -> list[StepReport]:
        """Write batches for steps after the last one on disk up to `steps`, then sync the final weights."""
        await self.pool.wait_ready()
        done = written_steps(self.config.rollouts_dir)
        first = (done[-1] + 1) if done else 1
        if first > 1:
            log.info("resuming after step %d (its batch is already on disk)", first - 1)
        reports = []
        for step in range(first, steps + 1):
            report = await self.run_step(step)
            reports.append(report)
            if on_step is not None:
                on_step(report)
        await self._wait_for_trainer(steps)
        await self._sync_weights()
        return reports

    async def run_step(self, step: int) -> StepReport:
        waited = await self._wait_for_trainer(step - self.config.orchestrator.max_async_level)
        started = time.perf_counter()
        await self._sync_weights()
        synced = time.perf_counter() - started
        started = time.perf_counter()
        rollouts, dropped, outcomes = await self._play_groups(step)
        samples = self._samples(rollouts)
        rewards = [r.reward for group in rollouts for r in group]
        if not rewards:
            raise AllRolloutsDropped(f"step {step}: all rollouts were dropped ({dict(dropped)})")
        report = StepReport(
            step=step,
            weights_step=self.weights_step,
            rollouts=len(rewards),
            dropped=dict(dropped),
            samples=len(samples),
            reward_mean=statistics.fmean(rewards),
            images_sent=sum(r.images for group in rollouts for r in group),
            rollout_seconds=time.perf_counter() - started,
            wait_seconds=waited,
            sync_seconds=synced,
            reward_by_label={label: statistics.fmean(scores) for label, scores in sorted(outcomes.items())},
        )
        metadata = {k: v for k, v in report.__dict__.items() if k != "step"}
        write_batch(self.config.rollouts_dir, RolloutBatch(step=step, samples=samples, metadata=metadata))
        self.metrics.step.set(step)
        self.metrics.reward_mean.set(report.reward_mean)
        return report

    async def _play_groups(
        self, step: int
    ) -> tuple[list[list[Rollout]], Counter[str], dict[str, list[float]]]:
        cfg = self.config.orchestrator
        sampling = Sampling(
            max_tokens=cfg.max_tokens, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p
        )
        ids = [
            [RolloutId(step, g, r) for r in range(cfg.rollouts_per_prompt)]
            for g in range(cfg.prompts_per_step)
        ]
        outcomes: dict[str, list[float]] = {}

        async def one(rollout_id: RolloutId) -> Rollout | str:
            # Same seed for the whole group: same task, same image bytes, same refs.
            episode = self.environment.episode(episode_seed(cfg.seed, step, rollout_id.group))
            try:
                rollout = await play(
                    episode,
                    rollout_id,
                    renderer=self.renderer,
                    pool=self.pool,
                    sampling=sampling,
                    max_turns=cfg.max_turns,
                    run_seed=cfg.seed,
                )
            except InvalidRefError as exc:
                log.error("dropping rollout %s: %s", rollout_id, exc)
                return "invalid_mm_image_ref"
            except RequestRejected as exc:
                log.error("dropping rollout %s: %s", rollout_id, exc)
                return "engine_rejected"
            self.metrics.rollouts.inc()
            self.metrics.rollout_seconds.observe(rollout.seconds)
            for label, score in episode.outcomes():
                outcomes.setdefault(label, []).append(score)
            return rollout

        results = await asyncio.gather(*(asyncio.gather(*(one(i) for i in group)) for group in ids))
        dropped: Counter[str] = Counter()
        kept = []
        for group in results:
            kept.append([r for r in group if isinstance(r, Rollout)])
            for reason in (r for r in group if isinstance(r, str)):
                dropped[reason] += 1
                self.metrics.samples_dropped.labels(reason=reason).inc()
        return kept, dropped, outcomes

    def _samples(self, groups: list[list[Rollout]]) -> list[Sample]:
        samples = []
        for group in groups:
            for rollout, advantage in zip(group, group_advantages([r.reward for r in group]), strict=True):
                samples.extend(branch_samples(rollout, advantage, self.renderer.placeholder_id))
        return samples

    async def _wait_for_trainer(self, step: int) -> float:
        """Wait until the trainer's latest checkpoint (broadcast mode: the weights every replica holds) is at
        least `step` (`CheckpointTimeout` after the checkpoint timeout); returns the seconds waited."""
        started = time.perf_counter()
        if self.broadcast:
            deadline = time.monotonic() + self._checkpoint_timeout_s
            while weights_step(self.config) < step:
                if time.monotonic() >= deadline:
                    raise CheckpointTimeout(
                        f"the trainer did not update the engines' weights to step {step} "
                        f"({self.config.weights_step_path}) within {self._checkpoint_timeout_s:.0f}s"
                    )
                await asyncio.sleep(self._poll_interval_s)
            return time.perf_counter() - started
        await wait_for_checkpoint(
            self.config.checkpoints_dir,
            step,
            timeout_s=self._checkpoint_timeout_s,
            poll_s=self._poll_interval_s,
        )
        return time.perf_counter() - started

    async def _sync_weights(self) -> None:
        if self.broadcast:  # the trainer updated the replicas itself
            latest = weights_step(self.config)
            if latest > self.weights_step:
                self.weights_step = latest
                self.metrics.weights_step.set(latest)
                log.info("replicas now serve the weights of step %d (broadcast by the trainer)", latest)
            return
        latest = latest_step(self.config.checkpoints_dir)
        if latest > self.weights_step:
            path = checkpoint_dir(self.config.checkpoints_dir, latest)
            await self.pool.load_weights(str(path.resolve()))
            self.weights_step = latest
            self.metrics.weights_step.set(latest)
            log.info("replicas now serve checkpoint step %d (%s)", latest, path)

    def _catch_up(self) -> tuple[bool, str | None]:
        """Broadcast mode: what a replica that missed updates loads before it serves again: the latest
        checkpoint (None: the base weights), once it holds the weights the others serve (not ready: False).
        With `trainer.checkpoint_every` above 1 that checkpoint may be steps behind and come only with the
        trainer's next step, which needs rollouts: waiting for it would deadlock a run whose replicas all
        restarted, so the replica serves the latest one now, until that next update (which fails on it and
        so has every replica load the step's checkpoint)."""
        latest = latest_step(self.config.checkpoints_dir)
        if latest < weights_step(self.config) and self.config.trainer.checkpoint_every == 1:
            return False, None  # the trainer is writing that step's checkpoint right now
        return True, str(checkpoint_dir(self.config.checkpoints_dir, latest).resolve()) if latest else None


def weights_step(config: RunConfig) -> int:
    """Broadcast mode: the newest step whose weights the trainer put into the replicas; 0 before the first."""
    return read_step(config.weights_step_path)


def episode_seed(run_seed: int, step: int, group: int) -> int:
    """The task of group `group` at `step`: distinct across steps and groups, fixed per run seed."""
    return (run_seed * 1_000_003 + step) * 1_009 + group


def print_report(report: StepReport, stream: TextIO = sys.stdout) -> None:
    print(report.log_line(), file=stream, flush=True)
