"""The trainer at real size on one GPU: today's step against branches + each image once + bf16, and the
attention implementations, both sides in one run.

A random-weight model with Qwen2-VL-2B-Instruct's shapes (text: hidden 1536, 28 layers, 12 heads, 2 KV
heads, intermediate 8960, vocabulary 151,936 tied to the embeddings; vision: depth 32, embed 1280, 16 heads;
2.21 B params), the tiny checkpoint's tokenizer and processor at the real pixel budget (a 1280x720
screenshot is 1196 placeholder tokens). The step batch is `--rollouts` rollouts of `--turns` turns, each
turn a new 1280x720 screenshot, played through the orchestrator's own `play` against a scripted engine (a
fixed reply and the end-of-turn token).

Variants (each: one warm-up step, then `--steps` timed steps; checkpoint writes left out):
- before: one sample per turn (`turn_samples`), every placeholder span encoded, FSDP2 on a one-rank
  group (bf16 compute: what the issue measured; a plain one-GPU run computed in fp32 then), logits of
  every token;
- after_fsdp: one sample per branch (`branch_samples`), each image encoded once per micro-batch, FSDP2
  as before: the data-path gain alone;
- after_ddp: the same batch on the one-GPU path: unsharded, bf16 autocast, sdpa;
- after_varlen: after_ddp with `rawmm_varlen` attention (varlen flash kernel, no mask);
- after_logits / after_logits_varlen: after_ddp / after_varlen with the logits computed only where a loss
  token is predicted (the trainer's default now; the variants above set `Trainer.all_logits`);
- after_compile: after_logits with `trainer.compile` (each decoder layer and vision block compiled; its
  warm-up step compiles, budgeted by `--compile-seconds`);
- after_compile_big: after_compile with `--big-micro-batch-tokens` per forward and activation checkpointing
  (fewer, longer forwards; the recompute is not counted as useful FLOPs);
- after_big_micro: after_logits with `--big-micro-batch-tokens` per forward (`--big-attn`), skipped when the
  last variant's activations scaled to it would not fit the GPU.
Per variant: step time, tokens/s, rollouts/s, peak memory and MFU against `--peak-tflops`. MFU counts the
useful model FLOPs (`step_flops`): decoder params x tokens, the lm_head at the loss tokens only, causal
attention within each sample, vision params x patches encoded (the merger's on merged tokens) and vision
attention within each image; "6N" is the first run's formula (6 x params x tokens, no attention) for
comparison. Then one step of `--profile` under torch.profiler (a profiled step runs slower): GPU busy
time against the step's wall time, kernel time by kind, top kernels. Then, on an unsharded trainer's
model, each attention implementation (`--attn`): whether transformers takes it, packed vs alone max
|logprob diff| on the loss tokens of the first per-turn micro-batch (its samples; bf16 autocast), and its
forward+backward time. JSON lines, then SUMMARY lines.

    python bench/trainer_gpu.py [--size real|tiny] [--turns 4] [--rollouts 3] [--steps 2] [--deadline 220]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # screens.py, as the other benches
START = time.perf_counter()
REAL_TEXT = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "vocab_size": 151936,  # the real vocabulary: the lm_head and its logits at full size (the tokenizer is tiny)
}
REAL_VISION = {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536}
REPLY = " click the search field, type the query and press enter"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a variant trains: which batch, how many tokens per forward, and how the trainer runs."""

    side: str  # "before" (a sample per turn) or "after" (a sample per branch)
    micro_tokens: int
    sharded: bool  # FSDP2 on a one-rank group, or unsharded with bf16 autocast
    attn: str
    once: bool  # each image encoded once per micro-batch
    all_logits: bool  # every token's logits, or only where a loss token is predicted
    compile: bool = False
    checkpointing: bool = False

    def build(self) -> tuple[bool, bool, bool]:
        """What only a new trainer changes."""
        return self.sharded, self.compile, self.checkpointing


def emit(event: str, **fields: Any) -> None:
    line = {"event": event, "t": round(time.perf_counter() - START, 1), **fields}
    print(json.dumps(line, default=str), flush=True)


class ShardedWorldOfOne(int):
    """World size 1 that compares as > 1: `Trainer` then takes its FSDP path on a one-rank group."""

    def __gt__(self, other: object) -> bool:
        return True if other == 1 else int(self) > other  # type: ignore[operator]


def real_config(model_dir: Path, size: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if size == "real":
        text, vision = config.text_config, config.vision_config
        for key, value in REAL_TEXT.items():
            setattr(text, key, value)
        text.layer_types = ["full_attention"] * text.num_hidden_layers
        rope = dict(text.rope_parameters)
        rope["mrope_section"] = [16, 24, 24]  # head_dim 128: 64 frequencies
        text.rope_parameters = rope
        config.tie_word_embeddings = text.tie_word_embeddings = True  # as Qwen2-VL-2B: 2.21 B params
        for key, value in REAL_VISION.items():
            setattr(vision, key, value)
        config.save_pretrained(model_dir)
    return config


class ScreensEpisode:
    """Turn t shows screenshot t (already offloaded); never done before the last turn."""

    def __init__(self, uris: list[str]) -> None:
        self.uris, self.turn = uris, 0

    def _show(self, text: str) -> dict[str, Any]:
        image = {"type": "image_url", "image_url": {"url": self.uris[self.turn]}}
        return {"role": "user", "content": [image, {"type": "text", "text": text}]}

    def start(self) -> list[dict[str, Any]]:
        return [self._show("what should we do on this screen?")]

    def step(self, reply: str) -> Any:
        from rawmm.rl.envs import StepResult

        self.turn += 1
        if self.turn == len(self.uris):
            return StepResult(reward=1.0, done=True)
        return StepResult(reward=0.0, done=False, messages=[self._show("here is the new screen")])


class ScriptedPool:
    def __init__(self, tokens: list[int], logprob: float) -> None:
        self.tokens, self.logprob = tokens, logprob

    async def generate(self, key: str, request: Any) -> tuple[str, Any]:
        from rawmm.contract.engine_api import GenerateResponse

        n = len(self.tokens)
        return "scripted", GenerateResponse(
            token_ids=self.tokens, logprobs=[self.logprob] * n, finish_reason="stop", weights_version=0
        )


def play_rollouts(renderer: Any, uris: list[list[str]]) -> list[Any]:
    import math

    from rawmm.contract.engine_api import Sampling
    from rawmm.rl.orchestrator.rollout import RolloutId, play

    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # about a random model's logprob: importance ratios near 1
    pool = ScriptedPool([*renderer.tokenizer.encode(REPLY), end], -math.log(len(renderer.tokenizer)))

    async def all_of_them() -> list[Any]:
        return list(
            await asyncio.gather(
                *(
                    play(
                        ScreensEpisode(row),  # type: ignore[arg-type]
                        RolloutId(1, index, 0),
                        renderer=renderer,
                        pool=pool,  # type: ignore[arg-type]
                        sampling=Sampling(max_tokens=32, temperature=1.0),
                        max_turns=len(row),
                        run_seed=0,
                    )
                    for index, row in enumerate(uris)
                )
            )
        )

    return asyncio.run(all_of_them())


def encoded_images(samples: list[Any], micro_batch_tokens: int, *, once: bool) -> list[tuple[int, int, int]]:
    """The `(t, h, w)` patch grid of every image the vision tower encodes in a step: each placeholder
    span's, or (`once`) each distinct image's once per micro-batch."""
    from rawmm.rl.trainer.packing import pack_samples

    grids: list[tuple[int, int, int]] = []
    for micro in pack_samples(samples, micro_batch_tokens):
        seen: dict[str, tuple[int, int, int]] = {}
        for image in micro.images:
            (t, h, w), *_ = image.descriptor["payload"]["image_grid_thw"]
            if once:
                seen[image.mm_hash] = (t, h, w)
            else:
                grids.append((t, h, w))
        grids += seen.values()
    return grids


def step_flops(
    samples: list[Any], grids: list[tuple[int, int, int]], dims: dict[str, float]
) -> dict[str, float]:
    """The step's model FLOPs (forward + backward = 3 x forward), by part; `useful` is their sum, what MFU
    counts, `six_n` the first run's formula (6 x params x tokens, text without embeddings, all vision).

    - text: 6 x the decoder layers' params x tokens forwarded;
    - lm_head: 6 x vocab x hidden x the tokens whose logprob the loss reads (the loss tokens): logits
      anywhere else are work nothing uses, whether or not a variant computes them;
    - text attention: causal within each sample, QK^T and AV at 2 n^2 d / 2 each, so 6 L d n^2 per
      sample (d = heads x head_dim); across packed samples nothing is useful (sdpa's mask computes it);
    - vision: 6 x the blocks' and patch embedding's params x patches, the merger's x patches / merge^2
      (it runs on merged tokens); vision attention: bidirectional within each frame, 12 L d p^2.
    """
    tokens = sum(len(s) for s in samples)
    loss_tokens = sum(sum(s.loss_mask[1:]) for s in samples)  # a sample's first token is never predicted
    patches = sum(t * h * w for t, h, w in grids)
    parts = {
        "text": 6.0 * dims["text_layers"] * tokens,
        "lm_head": 6.0 * dims["lm_head"] * loss_tokens,
        "text_attn": 6.0 * dims["text_layers_n"] * dims["text_attn_dim"] * sum(len(s) ** 2 for s in samples),
        "vision": 6.0 * dims["vision_blocks"] * patches + 6.0 * dims["merger"] * patches / dims["merge"],
        "vision_attn": 12.0
        * dims["vision_depth"]
        * dims["vision_dim"]
        * sum(t * (h * w) ** 2 for t, h, w in grids),
    }
    parts["useful"] = sum(parts.values())
    parts["six_n"] = 6.0 * dims["text_no_embed"] * tokens + 6.0 * dims["vision_all"] * patches
    return parts


KERNEL_KINDS = (  # first match wins: a kernel's kind by its name
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "sm90", "sm80", "matmul", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("memcpy", "memset", "copy", "cat", "index")),
    ("softmax/norm", ("softmax", "norm", "reduce")),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lower for w in words)), "elementwise/other")


def profile_step(trainer: Any, samples: list[Any], name: str, cuda: bool) -> str:
    """One train step of `name` under torch.profiler: the GPU's busy time against the step's wall time
    (the rest is the host: materializing, Python, launches, syncs), its kernel time by kind, and the top
    kernels (on CPU: the top ops by self CPU time). The full table goes to the log."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rawmm.rl.samples import RolloutBatch

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        report = trainer.train_step(RolloutBatch(step=trainer.step + 1, samples=samples))
        if cuda:
            torch.cuda.synchronize()
    wall_ms = report.step_seconds * 1e3
    if not cuda:
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        cpu_top = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f}ms" for e in ops)
        emit("profile", variant=name, step_ms=round(wall_ms), top_cpu_ops=cpu_top)
        return f"profile | {name} (CPU): step {wall_ms:.0f}ms; top self CPU: {cpu_top}"
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")  # the union of kernel intervals (streams may overlap)
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + us
        by_name.setdefault(e.name, []).append(us)
    top = sorted(by_name.items(), key=lambda kv: sum(kv[1]), reverse=True)[:25]
    for kernel, times in top:
        emit(
            "kernel",
            ms=round(sum(times) / 1e3, 1),
            calls=len(times),
            kind=kernel_kind(kernel),
            name=kernel[:160],
        )
    kinds = ", ".join(f"{k} {v / 1e3:.0f}ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    top5 = ", ".join(f"{k[:60]} {sum(t) / 1e3:.0f}ms x{len(t)}" for k, t in top[:5])
    emit("profile", variant=name, step_ms=round(wall_ms), gpu_busy_ms=round(busy / 1e3), kinds=by_kind)
    return (
        f"profile | {name}: step {wall_ms:.0f}ms, GPU busy {busy / 1e3:.0f}ms ({100 * busy / 1e3 / wall_ms:.0f}%), "
        f"materialize {report.materialize_seconds * 1e3:.0f}ms | by kind: {kinds} | top: {top5}"
    )


def main() -> None:  # noqa: PLR0915 - one linear script
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("real", "tiny"), default="real")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant")
    parser.add_argument("--image", default="1280x720")
    parser.add_argument("--max-pixels", type=int, default=12845056)
    parser.add_argument("--micro-batch-tokens", type=int, default=6144)
    parser.add_argument(
        "--variants",
        default="before,after_logits,after_compile,after_compile_big,after_fsdp,after_ddp,after_varlen,"
        "after_logits_varlen,after_big_micro",
    )
    parser.add_argument(
        "--compile-seconds", type=float, default=120.0, help="a compiled variant's budget for compiling"
    )
    parser.add_argument(
        "--big-micro-batch-tokens", type=int, help="after_big_micro's tokens per forward (default 2x)"
    )
    parser.add_argument("--big-attn", default="rawmm_varlen", help="after_big_micro's attention")
    parser.add_argument("--profile", default="after_compile", help="the variant to profile one step of")
    parser.add_argument("--attn", default="sdpa,rawmm_varlen,flex_attention,flash_attention_2")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak (H200 measured)")
    parser.add_argument("--deadline", type=float, default=220.0, help="seconds from start")
    parser.add_argument("--work")
    args = parser.parse_args()
    width, height = (int(v) for v in args.image.split("x"))
    args.big_micro_batch_tokens = args.big_micro_batch_tokens or 2 * args.micro_batch_tokens
    work = Path(args.work or tempfile.mkdtemp(prefix="rawmm-gpu-step-"))

    import torch
    import torch.distributed as dist
    from screens import screenshot_png
    from transformers import AutoModelForImageTextToText

    from rawmm.config import RunConfig
    from rawmm.contract import OffloadStore
    from rawmm.rl.orchestrator.rollout import PromptRenderer, branch_samples, turn_samples
    from rawmm.rl.samples import RolloutBatch
    from rawmm.rl.trainer.attention import register_varlen_attention
    from rawmm.rl.trainer.distributed import DistContext
    from rawmm.rl.trainer.forward import forward_logprobs, sample_starts
    from rawmm.rl.trainer.loop import Trainer
    from rawmm.rl.trainer.packing import concat_samples, pack_samples
    from rawmm.rl.trainer.precision import autocast
    from rawmm.run.tiny import build_tiny_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    emit("start", device=str(device), gpu=torch.cuda.get_device_name(0) if cuda else None, args=vars(args))
    register_varlen_attention()

    model_dir = build_tiny_model("qwen2_vl", work / "model", seed=0, max_pixels=args.max_pixels)
    model_config = real_config(model_dir, args.size)
    mbt = args.micro_batch_tokens
    config = RunConfig.from_mapping(
        {
            "model": {"path": str(model_dir), "preset": "qwen2_vl", "processor_backend": "torchvision"},
            "shared_dir": str(work / "shared"),
            "trainer": {"steps": 1000, "learning_rate": 1e-6, "seq_len": mbt, "micro_batch_tokens": mbt},
            "monitoring": {"trainer_metrics_port": 0, "orchestrator_metrics_port": 0},
        }
    )
    store = OffloadStore(config.offload_dir)
    uris = [
        [store.put(screenshot_png(r * 100 + t, width, height)).uri for t in range(args.turns)]
        for r in range(args.rollouts)
    ]
    renderer = PromptRenderer(model_dir, "qwen2_vl", "torchvision", store)
    rollouts = play_rollouts(renderer, uris)
    batches = {
        "before": [s for r in rollouts for s in turn_samples(r, 1.0, renderer.placeholder_id)],
        "after": [s for r in rollouts for s in branch_samples(r, 1.0, renderer.placeholder_id)],
    }
    for name, samples in batches.items():
        too_long = max(len(s) for s in samples)
        if too_long > mbt:
            raise SystemExit(
                f"a {name} sample has {too_long} tokens > --micro-batch-tokens {mbt}: fewer --turns"
            )
        emit(
            "batch",
            side=name,
            samples=len(samples),
            tokens=sum(len(s) for s in samples),
            loss_tokens=sum(sum(s.loss_mask) for s in samples),
            image_spans=sum(len(s.mm_refs) for s in samples),
            micro_batches=len(pack_samples(samples, mbt)),
        )

    def build_on_device(cls: Any, path: Any, *a: Any, **kw: Any) -> Any:
        with torch.device(device):
            return AutoModelForImageTextToText.from_config(model_config, dtype=torch.float32)

    AutoModelForImageTextToText.from_pretrained = classmethod(build_on_device)  # type: ignore[assignment,method-assign]

    def one_rank_group() -> None:
        if dist.is_initialized():
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if cuda:
            torch.cuda.set_device(0)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    trainer: Any = None
    dims: dict[str, float] = {}

    def make_trainer(plan: Plan) -> Any:
        nonlocal trainer
        trainer = None
        sharded = plan.sharded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if sharded:
            one_rank_group()
            ctx = DistContext(rank=0, world_size=ShardedWorldOfOne(1), device=device)
        else:
            ctx = DistContext(rank=0, world_size=1, device=device)
        started = time.perf_counter()
        parallelism = "fsdp" if sharded else "ddp"
        trainer_config = config.trainer.model_copy(
            update={
                "parallelism": parallelism,
                "compile": plan.compile,
                "activation_checkpointing": plan.checkpointing,
            }
        )
        made = Trainer(config.model_copy(update={"trainer": trainer_config}), ctx)
        made._checkpoint = lambda step: work / f"no-checkpoint-{step}"  # type: ignore[method-assign]
        base = made.model.model
        vision = sum(p.numel() for p in base.visual.parameters())
        text = sum(p.numel() for p in made.model.parameters()) - vision
        embed = base.language_model.embed_tokens.weight.numel()  # a lookup, not a matmul
        merger = sum(p.numel() for p in base.visual.merger.parameters())
        text_cfg, vision_cfg = model_config.text_config, model_config.vision_config
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        dims.update(
            text_no_embed=text - embed,  # the first run's count (its lm_head was the tiny vocabulary's)
            vision_all=vision,
            text_layers=sum(p.numel() for p in base.language_model.parameters()) - embed,
            lm_head=text_cfg.vocab_size * text_cfg.hidden_size,
            text_layers_n=text_cfg.num_hidden_layers,
            text_attn_dim=text_cfg.num_attention_heads * head_dim,
            vision_blocks=vision - merger,
            merger=merger,
            merge=vision_cfg.spatial_merge_size**2,
            vision_depth=vision_cfg.depth,
            vision_dim=vision_cfg.embed_dim,
        )
        emit(
            "trainer",
            sharded=made.sharded,
            seconds=round(time.perf_counter() - started, 1),
            params=text + vision,
            text_params=text,
            vision_params=vision,
            tied_lm_head=made.model.lm_head.weight is base.language_model.embed_tokens.weight,
            state_gib=round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None,
        )
        made.plan_build = plan.build()
        trainer = made
        return made

    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    last_step = 0.0
    memory: dict[str, float] = {}  # the last variant's state and peak (GiB): the big micro-batch's estimate

    def configure(plan: Plan) -> Any:
        if trainer is None or trainer.plan_build != plan.build():
            make_trainer(plan)
        trainer.model.set_attn_implementation(plan.attn)
        trainer.encode_once = plan.once
        trainer.all_logits = plan.all_logits
        update = {"micro_batch_tokens": plan.micro_tokens, "seq_len": max(plan.micro_tokens, mbt)}
        trainer.config = config.model_copy(
            update={"trainer": trainer.config.trainer.model_copy(update=update)}
        )
        return trainer

    def run_variant(name: str, plan: Plan) -> None:
        nonlocal last_step
        configure(plan)
        micro_tokens = plan.micro_tokens
        samples = batches[plan.side]
        tokens = sum(len(s) for s in samples)
        grids = encoded_images(samples, micro_tokens, once=plan.once)
        patches = sum(t * h * w for t, h, w in grids)
        flops = step_flops(samples, grids, dims)
        rows = []
        for i in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                memory["state"] = torch.cuda.memory_allocated() / 2**30
            r = trainer.train_step(RolloutBatch(step=trainer.step + 1, samples=samples))
            if cuda:
                torch.cuda.synchronize()
            row = {
                "variant": name,
                "warmup": i == 0,
                "step_s": round(r.step_seconds, 3),
                "materialize_s": round(r.materialize_seconds, 3),
                "tokens": tokens,
                "patches_encoded": patches,
                "micro_batches": len(pack_samples(samples, micro_tokens)),
                "tokens_per_s": round(tokens / r.step_seconds, 1),
                "rollouts_per_s": round(args.rollouts / r.step_seconds, 3),
                "mfu": round(flops["useful"] / r.step_seconds / (args.peak_tflops * 1e12), 4),
                "mfu_6n": round(flops["six_n"] / r.step_seconds / (args.peak_tflops * 1e12), 4),
                "tflop": {k: round(v / 1e12, 2) for k, v in flops.items()},
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "loss": r.loss,
                "loss_tokens": r.loss_tokens,
                "grad_norm": r.grad_norm,
                "logprob_diff_mean": r.logprob_diff_mean,
            }
            emit("step", **row)
            if i:
                rows.append(row)
        results[name] = {
            k: statistics.median(row[k] for row in rows)
            for k in ("step_s", "tokens_per_s", "rollouts_per_s", "mfu", "mfu_6n", "peak_gib")
            if rows[0][k] is not None
        } | {"tokens": tokens, "patches_encoded": patches}
        last_step = max(row["step_s"] for row in rows)
        if cuda:
            memory["peak"] = torch.cuda.max_memory_allocated() / 2**30

    big = args.big_micro_batch_tokens
    after_logits = Plan("after", mbt, sharded=False, attn="sdpa", once=True, all_logits=False)
    plans = {
        "before": Plan("before", mbt, sharded=True, attn="sdpa", once=False, all_logits=True),
        "after_fsdp": Plan("after", mbt, sharded=True, attn="sdpa", once=True, all_logits=True),
        "after_ddp": dataclasses.replace(after_logits, all_logits=True),
        "after_varlen": dataclasses.replace(after_logits, attn="rawmm_varlen", all_logits=True),
        "after_logits": after_logits,
        "after_logits_varlen": dataclasses.replace(after_logits, attn="rawmm_varlen"),
        "after_compile": dataclasses.replace(after_logits, compile=True),
        "after_compile_big": dataclasses.replace(
            after_logits, micro_tokens=big, compile=True, checkpointing=True
        ),
        "after_big_micro": dataclasses.replace(after_logits, micro_tokens=big, attn=args.big_attn),
    }

    def too_big(micro_tokens: int) -> str | None:
        """Whether `micro_tokens` per forward would exceed the GPU, by the last variant's activations
        (peak - state) times the samples per micro-batch now; None when it fits (or no GPU)."""
        if not cuda or "peak" not in memory:
            return None
        per_micro = max(len(m.samples) for m in pack_samples(batches["after"], micro_tokens))
        before = max(len(m.samples) for m in pack_samples(batches["after"], mbt))
        need = memory["state"] + (memory["peak"] - memory["state"]) * per_micro / before
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        return f"skipped (memory: ~{need:.0f} of {total:.0f} GiB)" if need > 0.92 * total else None

    for name in [v for v in args.variants.split(",") if v]:
        left = args.deadline - (time.perf_counter() - START)
        plan = plans[name]
        compiling = args.compile_seconds if plan.compile else 0.0
        if left < (args.steps + 1) * last_step * 1.5 + 20 + compiling:
            failed[name] = "skipped (deadline)"
            continue
        # activation checkpointing keeps about one layer's activations: the estimate does not apply
        skip = too_big(plan.micro_tokens) if plan.micro_tokens != mbt and not plan.checkpointing else None
        if skip:
            failed[name] = skip
            emit("variant_skipped", variant=name, reason=skip)
            continue
        try:
            run_variant(name, plan)
        except Exception as exc:  # noqa: BLE001 - a variant's failure is a result
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
            emit("variant_error", variant=name, traceback=traceback.format_exc())
            if "out of memory" in str(exc).lower():
                trainer = None

    emit("figures", results=results, failed=failed)
    before = results.get("before")
    parts = []
    for name, f in results.items():
        ratio = f" ({f['rollouts_per_s'] / before['rollouts_per_s']:.2f}x rollouts/s)" if before else ""
        peak = f" peak {f['peak_gib']:.1f}GiB" if "peak_gib" in f else ""
        parts.append(
            f"{name}: step {f['step_s']:.2f}s {f['tokens_per_s']:.0f} tok/s {f['rollouts_per_s']:.2f} rollouts/s "
            f"MFU {100 * f['mfu']:.1f}% (6N {100 * f['mfu_6n']:.1f}%){peak}{ratio}"
        )
    print("SUMMARY: steps | " + " | ".join(parts) + (f" | failed {failed}" if failed else ""), flush=True)
    if args.profile and args.deadline - (time.perf_counter() - START) > 3 * last_step + 20:
        try:
            plan = plans[args.profile]
            configure(plan)
            print("SUMMARY: " + profile_step(trainer, batches[plan.side], args.profile, cuda), flush=True)
        except Exception as exc:  # noqa: BLE001 - the figures above stand without it
            emit("profile_error", traceback=traceback.format_exc())
            print(f"SUMMARY: profile | {type(exc).__name__}: {exc}"[:300], flush=True)
    # Attention implementations on the unsharded trainer's model: the first per-turn micro-batch (a few samples).
    attention: dict[str, dict[str, Any]] = {}
    try:
        if trainer is None or trainer.sharded:
            make_trainer(after_logits)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the step figures above still stand
        print(f"SUMMARY: attention | no unsharded trainer: {type(exc).__name__}: {exc}"[:300], flush=True)
        sys.exit(1)
    model, materializer = trainer.model, trainer.materializer
    micro = pack_samples(batches["before"], mbt)[0]
    materializer.begin_step(10_000)
    packed_m = materializer.materialize(micro)
    alone_m = [materializer.materialize(concat_samples([s])) for s in micro.samples]
    policy, normalizer = materializer.forward_policy, materializer.normalizer

    def logprobs(m: Any) -> Any:  # the loss tokens' logprobs, as the trainer now computes them
        kwargs, index = m.unique_mm_kwargs()
        wanted = torch.tensor(m.batch.loss_mask, dtype=torch.bool)
        return forward_logprobs(
            model, m.batch, kwargs, policy, normalizer=normalizer, image_index=index, wanted=wanted
        )

    for impl in [a for a in args.attn.split(",") if a]:
        if args.deadline - (time.perf_counter() - START) < 15:
            attention[impl] = {"error": "skipped (deadline)"}
            continue
        try:
            model.set_attn_implementation(impl)
            with torch.no_grad(), autocast(device):
                packed = logprobs(packed_m)
                alone = torch.cat([logprobs(m) for m in alone_m])
            mask = torch.tensor(micro.loss_mask, device=packed.device) & ~sample_starts(micro.seq_lens).to(
                packed.device
            )
            diff = (packed - alone).abs()[mask].max().item()
            times = []
            for _ in range(3):
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                with autocast(device):
                    out = logprobs(packed_m)
                out[mask].sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
            attention[impl] = {
                "packed_vs_alone_max_diff": round(diff, 5),
                "fwd_bwd_s": round(statistics.median(times[1:]), 3),
                "tokens": len(micro),
            }
        except Exception as exc:  # noqa: BLE001 - an implementation transformers refuses is a result
            attention[impl] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            model.zero_grad(set_to_none=True)
        emit("attention", impl=impl, **attention[impl])

    print(
        "SUMMARY: attention | "
        + " | ".join(
            f"{impl}: "
            + (a["error"] if "error" in a else f"{a['fwd_bwd_s']:.3f}s diff {a['packed_vs_alone_max_diff']}")
            for impl, a in attention.items()
        ),
        flush=True,
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if any(not v.startswith("skipped") for v in failed.values()) else 0)


if __name__ == "__main__":
    main()
