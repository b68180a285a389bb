"""The training loop: wait for a step's rollout batch, train on it, write the step's checkpoint.

With `trainer.weight_transfer: broadcast` the step's weights go straight into the engine replicas before
its checkpoint is written (`rawmm.rl.trainer.weight_publish`), and a checkpoint is written only every
`trainer.checkpoint_every` steps (`checkpoint_due`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rawmm.config import RunConfig
from rawmm.contract.shared_dir import latest_step, train_state_dir
from rawmm.materialize import load_processor
from rawmm.materialize import metrics as shared_metrics
from rawmm.rl.batches import wait_for_batch
from rawmm.rl.samples import RolloutBatch, truncate_sample
from rawmm.rl.trainer import metrics
from rawmm.rl.trainer.blocks import compile_blocks
from rawmm.rl.trainer.checkpoint import resolve_model_dir, save_checkpoint
from rawmm.rl.trainer.distributed import DistContext, all_reduce_gradients, all_reduce_sum
from rawmm.rl.trainer.forward import encodes_images_once, forward_logprobs, sample_starts
from rawmm.rl.trainer.fsdp import load_from_rank0, meta_model, shard_model
from rawmm.rl.trainer.lockstep import Slot, append_filler, rank_slots
from rawmm.rl.trainer.loss import policy_gradient_loss
from rawmm.rl.trainer.materializer import MaterializedMicroBatch, RawImageMaterializer
from rawmm.rl.trainer.packing import pack_samples
from rawmm.rl.trainer.precision import autocast
from rawmm.rl.trainer.train_state import load_train_state
from rawmm.rl.trainer.weight_publish import Delivery, Published, WeightPublisher


@dataclass(frozen=True)
class TrainStepReport:
    step: int
    loss: float
    reward_mean: float
    samples: int
    tokens: int
    loss_tokens: int
    clipped_fraction: float
    logprob_diff_mean: float  # mean |trainer - engine| logprob over loss tokens (see LossParts)
    logprob_kl_mean: float  # mean k3 estimate of KL(engine || trainer) over loss tokens (see LossParts)
    grad_norm: float
    images: int
    images_materialized: int
    missing_images: int
    materialize_seconds: float
    step_seconds: float
    checkpoint: str | None  # None: a broadcast step between checkpoints (trainer.checkpoint_every)
    weights_delivery: Delivery  # how the step's weights reached the engines (rank 0's view)
    weights_seconds: float  # the broadcast (start..finish) or the reload rank 0 ran; 0 in checkpoint mode
    compiled_blocks: int  # the blocks trainer.compile compiled (0: eager), so a run's log says it took effect


def checkpoint_due(step: int, every: int, last_step: int, delivery: Delivery) -> bool:
    """Whether `step` writes a checkpoint: every `every` steps and on the run's last (what a resume reads),
    and whenever its weights did not go out by broadcast (the replicas then load this step's checkpoint),
    unless the replicas hold them already (a restarted trainer's step trained again: ``"held"``)."""
    return step % every == 0 or step >= last_step or delivery not in ("broadcast", "held")


def learning_rate_at(step: int, peak: float, warmup_steps: int) -> float:
    """Step `step`'s (1-based) learning rate: a linear warm-up to `peak` over `warmup_steps`, then `peak`.
    Adam's first steps move every weight by about the rate whatever its gradient, so a rate that suits
    later steps can wreck what the model started with (measured on the tiny colours run: 2e-3 from step 1
    broke the answer format at step 2)."""
    if warmup_steps <= 0:
        return peak
    return peak * min(1.0, step / warmup_steps)


class Trainer:
    """Trains one model on the run's rollout batches over `dist`: data-parallel (`ddp`: whole model and
    optimizer on every rank, gradients all-reduced) or sharded (`fsdp`, see `rawmm.rl.trainer.fsdp`)."""

    def __init__(self, config: RunConfig, dist: DistContext) -> None:
        from transformers import AutoModelForImageTextToText

        self.config = config
        self.dist = dist
        torch.manual_seed(config.trainer.seed)
        self.loaded = load_processor(
            config.model.path,
            backend=config.model.processor_backend,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.base_dir = resolve_model_dir(config.model.path)
        cfg = config.trainer
        self.sharded = cfg.parallelism == "fsdp" and dist.world_size > 1
        trust = config.model.trust_remote_code
        if self.sharded and not dist.is_main:
            self.model = meta_model(self.base_dir, trust_remote_code=trust)
        else:
            self.model = AutoModelForImageTextToText.from_pretrained(
                self.base_dir, dtype=torch.float32, trust_remote_code=trust
            )
        self.model.train()
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # before FSDP: its hooks stay outside the compiled blocks
        self.compiled_blocks = compile_blocks(self.model) if cfg.compile else 0
        if self.sharded:
            full_state = self.model.state_dict() if dist.is_main else {}
            shard_model(self.model, dist.device)
            load_from_rank0(self.model, full_state, dist.device)
            del full_state
        else:
            # transformers' decorator on PreTrainedModel.to declares the model as its first argument
            self.model.to(dist.device)  # type: ignore[arg-type]
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        # On GPU one fused kernel updates every parameter (one launch per step, not several per tensor).
        self.optimizer = torch.optim.AdamW(
            self.parameters,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            fused=True if dist.device.type == "cuda" else None,
        )
        # Resume from the newest checkpoint: its weights, AdamW moments and step, as the run left them.
        self.step = latest_step(config.checkpoints_dir)
        if self.step:
            state = train_state_dir(config.checkpoints_dir, self.step)
            resumed = load_train_state(self.model, self.optimizer, state)
            if resumed != self.step:
                raise ValueError(f"{state} holds the state of step {resumed}, expected {self.step}")
        self.materializer = RawImageMaterializer(
            self.loaded, roots=[config.offload_dir], missing_image_policy=config.trainer.missing_image_policy
        )
        # Each distinct image of a micro-batch through the vision tower once (a bench turns it off).
        self.encode_once = encodes_images_once(self.model)
        # Logits at the loss tokens only; True: every token's, as before (a bench compares the two).
        self.all_logits = False
        temperature = config.orchestrator.sampling.temperature
        # Greedy sampling has no temperature to undo; the engine reports plain logprobs then.
        self.temperature = temperature if temperature > 0 else 1.0
        self.publisher = (
            WeightPublisher(
                self.model,
                config.inference.urls,
                dist,
                sharded=self.sharded,
                weights_step_path=config.weights_step_path,
            )
            if cfg.weight_transfer == "broadcast"
            else None
        )

    def train_step(self, batch: RolloutBatch, *, last_step: int | None = None) -> TrainStepReport:
        """One optimizer step on `batch` (every rank passes the same batch); `last_step`, the run's last
        (default `trainer.steps`), always writes its checkpoint."""
        started = time.perf_counter()
        cfg = self.config.trainer
        samples = [truncate_sample(s, cfg.seq_len) for s in batch.samples]
        micro_batches = pack_samples(samples, cfg.micro_batch_tokens)
        slots = rank_slots(micro_batches, self.dist.rank, self.dist.world_size, lockstep=self.sharded)

        self.materializer.begin_step(batch.step)
        materialized = [self._materialize(slot) for slot in slots]
        stats = self.materializer.stats
        # Zero-loss samples drop out of the normalizer, so sum loss tokens only after materializing.
        local = torch.tensor(
            [
                sum(int(_loss_mask(m).sum()) for m in materialized),
                stats.images,
                stats.materialized,
                stats.missing,
            ],
            dtype=torch.float64,
            device=self.dist.device,  # NCCL reduces only device tensors
        )
        step_tokens, images, images_materialized, missing = (int(v) for v in all_reduce_sum(local))

        self.optimizer.zero_grad(set_to_none=True)
        # loss, clipped tokens, |logprob diff| sum, KL estimate sum
        loss_sum = torch.zeros(4, dtype=torch.float64, device=self.dist.device)
        for m in materialized:
            loss_sum += self._backward(m, step_tokens)
        if not self.sharded:  # FSDP reduce-scattered each unit's gradients during backward
            all_reduce_gradients(self.parameters)
        all_reduce_sum(loss_sum)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        for group in self.optimizer.param_groups:  # from the step alone, so a resumed run goes on alike
            group["lr"] = learning_rate_at(batch.step, cfg.learning_rate, cfg.lr_warmup_steps)
        self.optimizer.step()

        # Broadcast mode: the replicas get the weights first (the orchestrator goes on once they have them),
        # then the checkpoint is written for resume and catch-up, and loaded if the broadcast did not happen.
        sent = (
            self.publisher.send(batch.step)
            if self.publisher is not None
            else Published("checkpoint", 0.0, {})
        )
        saved = None
        delivery = self.publisher.agreed_delivery(sent) if self.publisher is not None else sent.delivery
        if checkpoint_due(batch.step, cfg.checkpoint_every, last_step or cfg.steps, delivery):
            saved = self._checkpoint(batch.step)
        if self.publisher is not None and saved is not None:
            sent = self.publisher.after_checkpoint(batch.step, saved, sent)
        result = TrainStepReport(
            step=batch.step,
            loss=float(loss_sum[0]),
            reward_mean=sum(s.reward for s in batch.samples) / max(len(batch.samples), 1),
            samples=len(batch.samples),
            tokens=sum(len(s) for s in samples),
            loss_tokens=step_tokens,
            clipped_fraction=float(loss_sum[1]) / max(step_tokens, 1),
            logprob_diff_mean=float(loss_sum[2]) / max(step_tokens, 1),
            logprob_kl_mean=float(loss_sum[3]) / max(step_tokens, 1),
            grad_norm=float(grad_norm),
            images=images,
            images_materialized=images_materialized,
            missing_images=missing,
            materialize_seconds=stats.seconds,
            step_seconds=time.perf_counter() - started,
            checkpoint=str(saved) if saved is not None else None,
            weights_delivery=sent.delivery,
            weights_seconds=sent.seconds,
            compiled_blocks=self.compiled_blocks,
        )
        self.step = batch.step
        if self.dist.is_main:
            _export(result)
        return result

    def _materialize(self, slot: Slot) -> MaterializedMicroBatch:
        real = self.materializer.materialize(slot.batch) if slot.batch is not None else None
        if slot.filler is None:
            assert real is not None  # a slot without filler is a micro-batch of the step
            return real
        # The materializer's own stand-in pixels (black, the ref's grid), as for a missing image.
        return append_filler(real, slot.filler, self.materializer._stand_in_inputs)

    def _backward(self, m: MaterializedMicroBatch, step_tokens: int) -> torch.Tensor:
        device = self.dist.device
        mm_kwargs, image_index = m.unique_mm_kwargs() if self.encode_once else (m.mm_kwargs(), None)
        loss_mask = _loss_mask(m)
        # FSDP's policy already computes in bf16 on GPU; an unsharded model gets it from autocast.
        with nullcontext() if self.sharded else autocast(device):
            new_logprobs = forward_logprobs(
                self.model,
                m.batch,
                mm_kwargs,
                self.materializer.forward_policy,
                normalizer=self.materializer.normalizer,
                temperature=self.temperature,
                image_index=image_index,
                # logits only where a loss token is predicted (a bench sets `all_logits` to compare)
                wanted=None if self.all_logits else loss_mask,
            )
        parts = policy_gradient_loss(
            new_logprobs,
            torch.tensor(m.batch.logprobs, dtype=torch.float32, device=device),
            torch.tensor(m.batch.advantages, dtype=torch.float32, device=device),
            loss_mask.to(device),
            clip_low=self.config.trainer.clip_ratio_low,
            clip_high=self.config.trainer.clip_ratio_high,
            step_tokens=step_tokens,
        )
        parts.loss.backward()
        return parts.summary()

    def _checkpoint(self, step: int) -> Path:
        return save_checkpoint(
            self.model,
            self.optimizer,
            self.base_dir,
            self.config.checkpoints_dir,
            step,
            is_main=self.dist.is_main,
        )

    def run(
        self,
        steps: int,
        *,
        batch_timeout: float,
        on_step: Callable[[TrainStepReport], None] | None = None,
    ) -> list[TrainStepReport]:
        """Train steps `latest + 1 .. steps`, each on its rollout batch once it appears (waiting at most
        `batch_timeout` seconds for each)."""
        results = []
        try:
            for step in range(self.step + 1, steps + 1):
                batch = wait_for_batch(self.config.rollouts_dir, step, timeout_s=batch_timeout)
                result = self.train_step(batch, last_step=steps)
                results.append(result)
                if on_step is not None:
                    on_step(result)
        finally:
            if self.publisher is not None:
                self.publisher.shutdown()
        return results


def _loss_mask(m: MaterializedMicroBatch) -> torch.Tensor:
    # A sample's first token has no prediction inside the sample, so it never carries loss.
    return torch.tensor(m.batch.loss_mask, dtype=torch.bool) & ~sample_starts(m.batch.seq_lens)


def _export(result: TrainStepReport) -> None:
    metrics.STEP.set(result.step)
    metrics.LOSS.set(result.loss)
    metrics.REWARD_MEAN.set(result.reward_mean)
    metrics.TOKENS.inc(result.tokens)
    metrics.MISSING_IMAGES.inc(result.missing_images)
    shared_metrics.IMAGES_MATERIALIZED.labels(side="trainer").inc(result.images_materialized)


def step_log_line(result: TrainStepReport) -> str:
    """One JSON line per step on stdout: what `rawmm run` and log collectors read."""
    return json.dumps({"event": "trainer_step", **asdict(result)}, sort_keys=True)
