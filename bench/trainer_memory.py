"""Per-rank training state and step time of `rawmm train`, FSDP vs DDP, on 2 ranks.

For each of `trainer.parallelism: ddp` and `fsdp`, a torchrun launch of 2 ranks trains a widened
random-weight Qwen2-VL (the tiny checkpoint's tokenizer and processor) on the same on-policy batches
with images. After the last step each rank reports the bytes it holds of
- parameters, gradients and AdamW state (its local shards under FSDP): the part FSDP divides by world;
- on CUDA also the allocator's peak (which adds activations and FSDP's transient all-gathers).
Step time is the median of the steps after the first, without the checkpoint write (reported apart).
It runs on CUDA where there is a GPU per rank, on CPU (gloo) otherwise.

Then, in one process, the image inputs one step holds: multi-turn episodes of 1280x720 screenshots at the
real Qwen2-VL pixel budget (every turn's sample resends the earlier screenshots), packed and materialized by
the trainer's materializer, which holds uint8 patches and normalizes on use; beside each uint8 figure the
float32 bytes the same inputs take normalized (what the trainer held before, bit-identical pixels).

    .venv/bin/python bench/trainer_memory.py [--steps 4] [--width 4] [--layers 4] [--images-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def widened_model(out: Path, width: int, layers: int) -> Path:
    """The tiny Qwen2-VL checkpoint with `width` x its widths (head dims kept) and `layers` layers."""
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from rawmm.run.tiny import build_tiny_model

    tiny = build_tiny_model("qwen2_vl", out, seed=0)
    config = AutoConfig.from_pretrained(tiny)
    text, vision = config.text_config, config.vision_config
    text.hidden_size *= width
    text.intermediate_size *= width
    text.num_attention_heads *= width
    text.num_key_value_heads *= width
    text.num_hidden_layers = layers
    text.layer_types = ["full_attention"] * layers
    vision.embed_dim *= width
    vision.num_heads *= width
    vision.hidden_size = text.hidden_size
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(tiny)
    return tiny


def prepare(work: Path, steps: int, width: int, layers: int) -> Path:
    """The model, the batches of every step and one run config per mode; returns the model dir."""
    sys.path.insert(0, str(ROOT / "tests" / "rl" / "trainer"))
    import yaml
    from rollout_kit import RolloutFactory, run_config

    model = widened_model(work / "model", width, layers)
    config = run_config(model, work / "shared", seq_len=256, micro_batch_tokens=256)
    rollouts = RolloutFactory(config)
    for step in range(1, steps + 1):
        rollouts.write(step, rollouts.standard_batch(seed=step) * 2)
    for mode in ("ddp", "fsdp"):
        values = config.model_dump(mode="json")
        values["trainer"].update(parallelism=mode, steps=steps)
        values["shared_dir"] = str(work / "shared")
        (work / f"{mode}.yaml").write_text(yaml.safe_dump(values))
    return model


def tensor_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def worker(config_file: str, steps: int) -> None:
    """One rank: train every step, then print what it holds."""
    import torch

    from rawmm.commands.run_config import load_run_config
    from rawmm.rl.trainer.distributed import init_distributed, shutdown_distributed
    from rawmm.rl.trainer.loop import Trainer

    config = load_run_config(config_file)
    dist = init_distributed()
    trainer = Trainer(config, dist)
    checkpoint_seconds: list[float] = []
    save = trainer._checkpoint

    def timed_checkpoint(step: int) -> Path:
        started = time.perf_counter()
        try:
            return save(step)
        finally:
            checkpoint_seconds.append(time.perf_counter() - started)

    trainer._checkpoint = timed_checkpoint  # type: ignore[method-assign]
    results = trainer.run(steps, batch_timeout=60)
    params = [p for p in trainer.model.parameters()]
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    report = {
        "rank": dist.rank,
        "mode": config.trainer.parallelism,
        "device": str(dist.device),
        "full_params": sum(p.numel() for p in params),  # a DTensor's numel is the global one
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": tensor_bytes(state),
        "step_seconds": [r.step_seconds - c for r, c in zip(results, checkpoint_seconds, strict=True)],
        "checkpoint_seconds": checkpoint_seconds,
        "loss": [r.loss for r in results],
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if dist.device.type == "cuda" else None,
    }
    # A file per rank: the ranks' stdout lines interleave.
    Path(config_file).with_name(f"{report['mode']}-rank{dist.rank}.json").write_text(json.dumps(report))
    shutdown_distributed()


def launch(config_file: Path, steps: int) -> list[dict]:
    shutil.rmtree(config_file.parent / "shared" / "checkpoints", ignore_errors=True)  # from the base model
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if torch.cuda.device_count() < WORLD:  # NCCL wants a GPU per rank: fewer GPUs means a CPU run (gloo)
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
        + [__file__, "--worker", str(config_file), "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"{config_file.stem} run failed:\n{done.stderr[-4000:]}")
    mode = config_file.stem
    reports = [json.loads(config_file.with_name(f"{mode}-rank{r}.json").read_text()) for r in range(WORLD)]
    return sorted(reports, key=lambda r: r["rank"])


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def episode_samples(work: Path, episodes: int, turns: int) -> tuple[Path, list, Path]:
    """The model, one sample per turn of every episode (turn t carries screenshots 0..t) and the store root."""
    sys.path.insert(0, str(ROOT / "bench"))
    from screens import screenshot_png
    from transformers import AutoTokenizer

    from rawmm.contract import OffloadStore, render_chat
    from rawmm.materialize import load_processor
    from rawmm.rl.samples import completion_sample
    from rawmm.run.tiny import build_tiny_model

    # The preset's own max_pixels, so a 1280x720 screenshot keeps its real size (1288x728 after resize).
    model = build_tiny_model("qwen2_vl", work / "fullres", max_pixels=12845056)
    loaded = load_processor(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    store = OffloadStore(work / "offload")
    completion = tokenizer.encode(" click")
    samples = []
    for episode in range(episodes):
        uris = [store.put(screenshot_png(episode * turns + t)).uri for t in range(turns)]
        for turn in range(turns):
            parts = [{"type": "image_url", "image_url": {"url": uri}} for uri in uris[: turn + 1]]
            messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "act"}]}]
            prompt = render_chat(
                messages, tokenizer=tokenizer, family=loaded.family, config=loaded.config, store=store
            )
            samples.append(
                completion_sample(
                    prompt,
                    completion,
                    [-1.0] * len(completion),
                    advantage=1.0,
                    reward=1.0,
                    sample_id=f"e{episode}-t{turn}",
                )
            )
    return model, samples, store.root


def image_memory(work: Path, episodes: int, turns: int, micro_batch_tokens: int) -> None:
    """Print the image bytes held per micro-batch and per step, float32 vs uint8, with their ratios."""
    import torch

    from rawmm.contract import RawImageDescriptor
    from rawmm.materialize import get_adapter, load_processor, read_ref_image
    from rawmm.rl.trainer.materializer import RawImageMaterializer
    from rawmm.rl.trainer.packing import pack_samples

    model, samples, root = episode_samples(work, episodes, turns)
    loaded = load_processor(model)
    materializer = RawImageMaterializer(loaded, roots=[root], missing_image_policy="error")
    materializer.begin_step(1)
    started = time.perf_counter()
    micro_batches = [materializer.materialize(mb) for mb in pack_samples(samples, micro_batch_tokens)]
    materialize_s = time.perf_counter() - started
    stats = materializer.stats

    def nbytes(kwargs: dict[str, torch.Tensor]) -> int:
        return sum(t.nbytes for t in kwargs.values())

    rows, normalize_s = [], 0.0
    for m in micro_batches:  # what one forward pass is given: uint8 now, float32 normalized before
        raw = m.mm_kwargs()
        started = time.perf_counter()
        normalized = materializer.normalizer.inputs(raw)
        normalize_s += time.perf_counter() - started
        rows.append((len(m.images), nbytes(raw), nbytes(normalized)))
    # The step holds each unique image once (repeats share it) from materialization to the last forward.
    unique = {
        id(inputs["pixel_values"]): (ref, inputs)
        for m in micro_batches
        for ref, inputs in zip(m.batch.images, m.images, strict=True)
    }
    assert len(unique) == stats.materialized == episodes * turns
    step_uint8 = sum(nbytes(inputs) for _, inputs in unique.values())
    assert step_uint8 == stats.held_bytes
    # The old side, in this run: each unique image read and processed to normalized float32 pixels.
    step_float32, old_s = 0, 0.0
    for ref, inputs in unique.values():
        started = time.perf_counter()
        descriptor = RawImageDescriptor.from_dict(ref.descriptor)
        pixels = read_ref_image(descriptor, mm_hash=ref.mm_hash, roots=[root], max_pixels=10**8)
        old = get_adapter(loaded.family.name).materialize_for_trainer([pixels], [descriptor], loaded).kwargs
        old_s += time.perf_counter() - started
        step_float32 += nbytes(old)
        assert torch.equal(materializer.normalizer(inputs["pixel_values"]), old["pixel_values"])  # bit-exact

    print(
        f"\nimage inputs of one step: {episodes} episodes x {turns} turns of 1280x720 screenshots, "
        f"{len(samples)} samples in {len(micro_batches)} micro-batches of <= {micro_batch_tokens} tokens"
    )
    print(
        f"images referenced {stats.images}, materialized {stats.materialized} (= unique images); "
        f"pixels after normalize-on-use equal the float32 path's bit for bit"
    )
    print(
        f"CPU per step: float32 path materialize {old_s:.2f}s; uint8 path materialize {materialize_s:.2f}s "
        f"+ normalize on use {normalize_s:.2f}s (on the trainer's device when it has one)"
    )
    print(f"{'':16} {'images':>6} {'float32':>12} {'uint8':>12} {'ratio':>6}")
    for index, (images, uint8, float32) in enumerate(rows):
        print(f"micro-batch {index:<4} {images:>6} {mib(float32)} {mib(uint8)} {float32 / uint8:6.2f}")
    largest = max(rows, key=lambda r: r[2])
    print(
        f"{'largest mb':16} {largest[0]:>6} {mib(largest[2])} {mib(largest[1])} {largest[2] / largest[1]:6.2f}"
    )
    print(
        f"{'step (held)':16} {len(unique):>6} {mib(step_float32)} {mib(step_uint8)} {step_float32 / step_uint8:6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=4, help="multiplier of the tiny model's widths")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=2, help="screenshot episodes of the image step")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--images-only", action="store_true", help="only the image-inputs section")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    if args.images_only:
        with tempfile.TemporaryDirectory(prefix="rawmm-trainer-memory-") as tmp:
            return image_memory(Path(tmp), args.episodes, args.turns, args.micro_batch_tokens)

    with tempfile.TemporaryDirectory(prefix="rawmm-trainer-memory-") as tmp:
        work = Path(tmp)
        prepare(work, args.steps, args.width, args.layers)
        reports = {mode: launch(work / f"{mode}.yaml", args.steps) for mode in ("ddp", "fsdp")}

    ddp, fsdp = reports["ddp"], reports["fsdp"]
    print(f"model: {ddp[0]['full_params']:,} parameters (fp32), {WORLD} ranks on {ddp[0]['device']}")
    print(f"{'':6} {'rank':>4} {'params':>12} {'grads':>12} {'AdamW':>12} {'sum':>12} {'cuda peak':>12}")
    for mode, ranks in reports.items():
        for r in ranks:
            total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
            peak = mib(r["cuda_peak_bytes"]) if r["cuda_peak_bytes"] is not None else f"{'n/a':>12}"
            print(
                f"{mode:6} {r['rank']:>4} {mib(r['param_bytes'])} {mib(r['grad_bytes'])} "
                f"{mib(r['optimizer_bytes'])} {mib(total)} {peak}"
            )

    def state_bytes(r: dict) -> int:
        return r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]

    ratio = max(state_bytes(r) for r in fsdp) / max(state_bytes(r) for r in ddp)
    print(
        f"fsdp / ddp per-rank params + grads + AdamW (largest rank): {ratio:.3f} (1/world = {1 / WORLD:.3f})"
    )

    def step_time(ranks: list[dict]) -> float:  # the slowest rank sets the pace; the first step warms up
        return statistics.median(max(r["step_seconds"][i] for r in ranks) for i in range(1, args.steps))

    def checkpoint_time(ranks: list[dict]) -> float:
        return statistics.median(max(r["checkpoint_seconds"][i] for r in ranks) for i in range(1, args.steps))

    print(
        f"step time without checkpoint: ddp {step_time(ddp):.3f}s, fsdp {step_time(fsdp):.3f}s, "
        f"fsdp / ddp = {step_time(fsdp) / step_time(ddp):.2f}"
    )
    print(f"checkpoint write: ddp {checkpoint_time(ddp):.3f}s, fsdp {checkpoint_time(fsdp):.3f}s")
    print(
        f"loss per step: ddp {[round(x, 6) for x in ddp[0]['loss']]}, fsdp {[round(x, 6) for x in fsdp[0]['loss']]}"
    )
    with tempfile.TemporaryDirectory(prefix="rawmm-trainer-memory-") as tmp:
        image_memory(Path(tmp), args.episodes, args.turns, args.micro_batch_tokens)


if __name__ == "__main__":
    main()
