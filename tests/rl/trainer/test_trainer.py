"""The trainer on the tiny model: a real step from a batch file to a loadable checkpoint."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rawmm.contract.shared_dir import checkpoint_dir, latest_step
from rawmm.rl.trainer.distributed import init_distributed
from rawmm.rl.trainer.loop import Trainer, checkpoint_due, learning_rate_at
from rawmm.rl.trainer.materializer import MissingImageError
from rawmm.rl.trainer.precision import compute_dtype


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_step_trains_towards_positive_advantages_and_checkpoints(rollouts, tiny_qwen2_vl):
    samples = rollouts.standard_batch()
    rollouts.write(1, samples)
    images_before = metric("rawmm_images_materialized_total", side="trainer")
    tokens_before = metric("rawmm_trainer_tokens_total")

    trainer = Trainer(rollouts.config, init_distributed())
    [result] = trainer.run(1, batch_timeout=5)

    assert result.step == 1 and torch.isfinite(torch.tensor(result.loss))
    assert result.compiled_blocks == 0  # eager unless trainer.compile asks
    # The batch's logprobs came from this very model and pixels (fp32, CPU): the trainer reproduces them,
    # as exactly as its precision policy computes. fp32 (CPU): 1e-4 (measured 3e-8). bf16 compute (GPU):
    # 2^-8 ~ 4e-3, one bf16 rounding unit: measured 4.2e-4 on an H200, while the breaks this guards
    # against are far above it on this batch (CPU, fp32): black pixels 6.7e-2, per-sample positions
    # lost (samples see each other) 2.6e-2.
    bound = 1e-4 if compute_dtype(trainer.dist.device) == torch.float32 else 2**-8
    assert result.logprob_diff_mean < bound and result.clipped_fraction == 0.0
    # 2 shared prompt images + 2 zoom images referenced 6 times: each is read and processed once.
    assert (result.images, result.images_materialized, result.missing_images) == (6, 4, 0)
    assert result.loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert metric("rawmm_trainer_step") == 1
    assert metric("rawmm_trainer_loss") == pytest.approx(result.loss)
    assert metric("rawmm_trainer_reward_mean") == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert metric("rawmm_images_materialized_total", side="trainer") - images_before == 4
    assert metric("rawmm_trainer_tokens_total") - tokens_before == sum(len(s) for s in samples)

    # A complete from_pretrained checkpoint, published through `latest`.
    saved = checkpoint_dir(rollouts.config.checkpoints_dir, 1)
    assert latest_step(rollouts.config.checkpoints_dir) == 1 and result.checkpoint == str(saved)
    assert not saved.with_name("step_1.tmp").exists()
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(saved).encode("a red circle") == rollouts.renderer.tokenizer.encode(
        "a red circle"
    )
    before, after = load_file(tiny_qwen2_vl / "model.safetensors"), load_file(saved / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # The update raised the likelihood of the positively rewarded completion and lowered the other.
    rollouts.model = AutoModelForImageTextToText.from_pretrained(saved, dtype=torch.float32).eval()
    for sample, sign in ((samples[0], 1), (samples[1], -1)):
        new = torch.tensor(rollouts.logprobs(sample))
        mask = torch.tensor(sample.loss_mask)
        change = (new[mask] - torch.tensor(sample.logprobs)[mask]).sum()
        assert sign * change > 0, (sample.sample_id, change)


def test_zero_loss_drops_only_the_sample_with_a_missing_image(rollouts, make_config):
    samples = rollouts.standard_batch()
    broken = samples[2]  # g1-r0: its prompt image is shared with g1-r1
    rollouts.delete_image(broken.mm_refs[0].uri)
    rollouts.write(1, samples)
    missing_before = metric("rawmm_trainer_missing_images_total")

    trainer = Trainer(make_config(missing_image_policy="zero_loss"), init_distributed())
    [result] = trainer.run(1, batch_timeout=5)

    # Both samples of group 1 carry the deleted image; the other group and the text sample train.
    affected = [s for s in samples if any(r.uri == broken.mm_refs[0].uri for r in s.mm_refs)]
    assert {s.sample_id for s in affected} == {"g1-r0", "g1-r1"}
    assert result.missing_images == 2
    assert result.loss_tokens == sum(sum(s.loss_mask) for s in samples if s not in affected)
    assert metric("rawmm_trainer_missing_images_total") - missing_before == 2
    assert latest_step(rollouts.config.checkpoints_dir) == 1


def test_missing_image_under_error_stops_with_step_and_uri(rollouts):
    samples = rollouts.standard_batch()
    uri = samples[0].mm_refs[0].uri
    rollouts.delete_image(uri)
    rollouts.write(1, samples)
    trainer = Trainer(rollouts.config, init_distributed())
    with pytest.raises(MissingImageError, match=rf"step 1: .*'g0-r0': {uri}"):
        trainer.run(1, batch_timeout=5)
    assert latest_step(rollouts.config.checkpoints_dir) == 0  # nothing was published


def test_resume_continues_adamw_exactly_as_without_a_stop(rollouts, tmp_path):
    rollouts.write(1, rollouts.standard_batch())
    rollouts.write(2, rollouts.standard_batch(seed=3))
    config = rollouts.config
    no_stop = Trainer(config, init_distributed()).run(2, batch_timeout=5)
    config.checkpoints_dir.rename(tmp_path / "no-stop")

    Trainer(config, init_distributed()).run(1, batch_timeout=5)
    resumed = Trainer(config, init_distributed())  # a new process would build exactly this
    assert resumed.step == 1
    [second] = resumed.run(2, batch_timeout=5)
    assert (second.step, second.loss, second.grad_norm) == (2, no_stop[1].loss, no_stop[1].grad_norm)
    want = load_file(checkpoint_dir(tmp_path / "no-stop", 2) / "model.safetensors")
    got = load_file(checkpoint_dir(config.checkpoints_dir, 2) / "model.safetensors")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert latest_step(config.checkpoints_dir) == 2


def test_activation_checkpointing_saves_less_for_backward_and_changes_nothing_else(
    rollouts, make_config, tmp_path
):
    rollouts.write(1, rollouts.standard_batch())
    results, saved = {}, {}
    for checkpointing in (False, True):
        trainer = Trainer(make_config(activation_checkpointing=checkpointing), init_distributed())
        sizes: list[int] = []
        # What autograd keeps for backward; a checkpointed layer keeps only its inputs (and recomputes).
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, sizes=sizes: sizes.append(t.numel()) or t, lambda t: t
        ):
            [results[checkpointing]] = trainer.run(1, batch_timeout=5)
        saved[checkpointing] = sum(sizes)
        trainer.config.checkpoints_dir.rename(tmp_path / f"checkpointing-{checkpointing}")
    assert saved[True] < 0.5 * saved[False]
    assert results[True].loss == pytest.approx(results[False].loss, abs=1e-7)
    assert results[True].grad_norm == pytest.approx(results[False].grad_norm, rel=1e-6)
    plain = load_file(checkpoint_dir(tmp_path / "checkpointing-False", 1) / "model.safetensors")
    recomputed = load_file(checkpoint_dir(tmp_path / "checkpointing-True", 1) / "model.safetensors")
    for name, tensor in plain.items():
        torch.testing.assert_close(recomputed[name], tensor, rtol=0, atol=1e-7, msg=name)


def test_a_tiny_max_grad_norm_bounds_the_weight_update_as_the_clip_implies(rollouts, make_config):
    rollouts.write(1, rollouts.standard_batch())
    trainer = Trainer(make_config(), init_distributed())
    [group] = trainer.optimizer.param_groups
    lr, eps = group["lr"], group["eps"]
    # Clip to AdamW's eps: its first step moves each weight by lr*g/(|g|+eps), and with |g| <= eps that
    # is between lr*g/(2*eps) and lr*g/eps, so the whole update's norm lies in [lr/2, lr].
    trainer.config.trainer.max_grad_norm = eps
    before = [p.detach().clone() for p in trainer.parameters]
    [result] = trainer.run(1, batch_timeout=5)
    update = torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.parameters, before, strict=True)])

    assert result.grad_norm > 1e3 * eps  # the clip binds (the report is the norm before clipping)
    # Unclipped, the step would move each weight that has a gradient by about lr: hundreds of lr in norm.
    assert 0.5 * lr <= float(update.norm()) <= 1.01 * lr  # 1%: float32 rounding of the weights


def test_the_learning_rate_warms_up_linearly_then_holds():
    """The run's `trainer.lr_warmup_steps`: step n of N trains at n/N of the rate, then at the rate."""
    assert [learning_rate_at(step, 3e-3, 5) for step in range(1, 8)] == pytest.approx(
        [6e-4, 1.2e-3, 1.8e-3, 2.4e-3, 3e-3, 3e-3, 3e-3]
    )
    assert learning_rate_at(1, 3e-3, 0) == 3e-3


def test_a_checkpoint_is_due_every_n_steps_on_the_last_and_whenever_the_broadcast_did_not_deliver():
    """`trainer.checkpoint_every`: a broadcast step between checkpoints writes none; a step whose replicas
    must reload it (the broadcast skipped or failed) and the run's last step always write theirs."""
    due = [step for step in range(1, 8) if checkpoint_due(step, 3, 7, "broadcast")]
    assert due == [3, 6, 7]
    assert checkpoint_due(4, 3, 7, "reload") and checkpoint_due(4, 3, 9, "checkpoint")
    assert not checkpoint_due(4, 3, 9, "held")  # a step trained again, its weights on the replicas already
    assert checkpoint_due(9, 3, 9, "held")
    assert all(checkpoint_due(step, 1, 7, "broadcast") for step in range(1, 8))  # the default: every step
