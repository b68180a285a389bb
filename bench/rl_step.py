"""Where an RL step's time goes on the tiny model, and what an in-flight rollout costs the orchestrator.

1. A real local run (`rawmm run`, examples/local-tiny.yaml: engine + orchestrator + trainer processes):
   per step, rollout wall time, engine-side materialization, trainer step time; engine tokens/s and
   images/s, from the step lines and the engines' /metrics.
2. The run's batches replayed on the trainer side in this process: materialization vs forward/backward
   per step, training tokens/s and images/s.
3. Orchestrator resident memory per in-flight rollout (a 3-turn conversation of 1280x720 screenshots
   at its last turn), measured in fresh processes: with raw image refs (this design) vs with inline
   pixels (data: URLs in the messages plus the processed pixel tensors a tensor-carrying design ships).

    .venv/bin/python bench/rl_step.py [--steps 3]
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SCREEN = (1280, 720)
TURNS = 3


def run_loop(steps: int, out: Path) -> tuple[dict, dict]:
    """A real local run; returns its summary and the engines' final metrics."""
    from rawmm.config import RunConfig
    from rawmm.run import LocalRun, plan_local_run
    from rawmm.run.plan import free_port

    config = RunConfig.from_yaml(ROOT / "examples" / "local-tiny.yaml")
    config = config.model_copy(
        update={"inference": config.inference.model_copy(update={"base_port": free_port()})}
    )
    final: dict = {}

    def keep_engine_metrics(run: LocalRun) -> None:
        final.update(run.state.engines)

    summary = LocalRun(
        plan_local_run(config, steps=steps, output_dir=out), on_finished=keep_engine_metrics
    ).run()
    return summary, final


def engine_figures(summary: dict, engines: dict) -> dict:
    per_step = [s["orchestrator"] for s in summary["per_step"] if s["orchestrator"]]
    rollout_s = sum(s["rollout_seconds"] for s in per_step)

    def total(name: str, **labels: str) -> float:
        return sum((scrape.value(name, **labels) or 0.0) for scrape in engines.values())

    materialize_s = total("rawmm_materialize_seconds_sum", side="engine")
    return {
        "steps": len(per_step),
        "rollout_s_per_step": rollout_s / len(per_step),
        "engine_materialize_s_per_step": materialize_s / len(per_step),
        "images_sent_per_step": statistics.fmean(s["images_sent"] for s in per_step),
        "engine_images_materialized": total("rawmm_images_materialized_total", side="engine"),
        "generated_tokens_per_s": sum(
            s.total("rawmm_engine_generated_tokens_total") for s in engines.values()
        )
        / rollout_s,
        "image_refs_per_s": sum(s["images_sent"] for s in per_step) / rollout_s,
        "cache_hit_rate": summary["cache_hit_rate"],
        "trainer_step_s": statistics.fmean(
            s["trainer"]["step_seconds"] for s in summary["per_step"] if s["trainer"]
        ),
        "trainer_materialize_s_in_process": statistics.fmean(
            s["trainer"]["materialize_seconds"] for s in summary["per_step"] if s["trainer"]
        ),
    }


def replay_trainer(config_path: Path) -> dict:
    """Materialize and forward/backward every batch of the run, timing each part separately."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rawmm.config import RunConfig
    from rawmm.contract.shared_dir import written_steps
    from rawmm.materialize import load_processor
    from rawmm.rl.batches import read_batch
    from rawmm.rl.samples import truncate_sample
    from rawmm.rl.trainer.forward import forward_logprobs
    from rawmm.rl.trainer.loss import policy_gradient_loss
    from rawmm.rl.trainer.materializer import RawImageMaterializer
    from rawmm.rl.trainer.packing import pack_samples

    config = RunConfig.from_yaml(config_path)
    loaded = load_processor(config.model.path, backend=config.model.backend)
    model = AutoModelForImageTextToText.from_pretrained(config.model.path, dtype=torch.float32)
    model.train()
    materializer = RawImageMaterializer(loaded, roots=[config.offload_dir], missing_image_policy="zero_loss")
    rows = []
    for step in written_steps(config.rollouts_dir):
        batch = read_batch(config.rollouts_dir, step)
        samples = [truncate_sample(s, config.trainer.seq_len) for s in batch.samples]
        micro_batches = pack_samples(samples, config.trainer.micro_batch_tokens)
        materializer.begin_step(step)
        started = time.perf_counter()
        materialized = [materializer.materialize(mb) for mb in micro_batches]
        materialize_s = time.perf_counter() - started
        started = time.perf_counter()
        tokens = 0
        for m in materialized:
            logprobs = forward_logprobs(
                model, m.batch, m.mm_kwargs(), materializer.forward_policy, normalizer=materializer.normalizer
            )
            mask = torch.tensor(m.batch.loss_mask)
            loss = policy_gradient_loss(
                logprobs,
                torch.tensor(m.batch.logprobs),
                torch.tensor(m.batch.advantages),
                mask,
                clip_low=0.2,
                clip_high=0.28,
                step_tokens=max(int(mask.sum()), 1),
            ).loss
            loss.backward()
            tokens += len(m.batch.token_ids)
        model.zero_grad(set_to_none=True)
        rows.append(
            {
                "materialize_s": materialize_s,
                "forward_backward_s": time.perf_counter() - started,
                "tokens": tokens,
                "images": materializer.stats.images,
                "materialized": materializer.stats.materialized,
            }
        )
    n = len(rows)
    return {
        "materialize_s_per_step": sum(r["materialize_s"] for r in rows) / n,
        "forward_backward_s_per_step": sum(r["forward_backward_s"] for r in rows) / n,
        "train_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["forward_backward_s"] for r in rows),
        "train_images_per_s": sum(r["materialized"] for r in rows) / sum(r["materialize_s"] for r in rows),
        "images_per_step": sum(r["images"] for r in rows) / n,
        "materialized_per_step": sum(r["materialized"] for r in rows) / n,
    }


# --- orchestrator memory per in-flight rollout ---------------------------------------------------


def screenshot(index: int) -> Image.Image:
    """A screenshot-like image: flat panels, text-like stripes and some noise (unique per index)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(index)
    image = Image.new("RGB", SCREEN, (250, 250, 250))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.randrange(SCREEN[0]), rng.randrange(SCREEN[1])
        fill = tuple(rng.randrange(256) for _ in range(3))
        draw.rectangle((x, y, x + rng.randrange(20, 300), y + rng.randrange(8, 120)), fill=fill)
    for line in range(0, SCREEN[1], 18):
        draw.text((20, line), f"row {line} item {index} " * 8, fill=(20, 20, 20))
    noise = Image.effect_noise((SCREEN[0] // 4, SCREEN[1] // 4), 40).convert("RGB").resize(SCREEN)
    return Image.blend(image, noise, 0.08)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_worker(mode: str, rollouts: int, model: str) -> None:
    """Hold `rollouts` in-flight rollouts at their last turn the way `mode` does; print bytes per rollout."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from rawmm.contract import OffloadStore, render_chat, resolve_preset
    from rawmm.materialize import get_adapter, load_processor

    family, _ = resolve_preset("qwen2_vl")
    config = family.config_from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    loaded = load_processor(model)
    adapter = get_adapter(family.name)
    # One screenshot per turn, shared by all rollouts: each rollout still builds its own messages, prompt
    # and tensors from them, which is exactly the per-rollout state being measured.
    pngs = []
    for t in range(TURNS):
        buffer = io.BytesIO()
        screenshot(t).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    with tempfile.TemporaryDirectory() as tmp:
        store = OffloadStore(tmp)

        def conversation(url_of) -> list[dict]:  # noqa: ANN001
            messages = []
            for t in range(TURNS):
                part = {"type": "image_url", "image_url": {"url": url_of(pngs[t])}}
                messages.append(
                    {"role": "user", "content": [part, {"type": "text", "text": f"turn {t}: act"}]}
                )
                if t + 1 < TURNS:
                    messages.append({"role": "assistant", "content": "next"})
            return messages

        def data_url(png: bytes) -> str:
            return "data:image/png;base64," + base64.b64encode(png).decode()

        def hold(_: int) -> tuple:
            if mode == "refs":
                messages = conversation(lambda png: store.put(png).uri)
                prompt = render_chat(messages, tokenizer=tokenizer, family=family, config=config, store=store)
                return messages, prompt.token_ids, prompt.mm_token_type_ids, prompt.features()
            messages = conversation(data_url)
            prompt = render_chat(messages, tokenizer=tokenizer, family=family, config=config, store=store)
            decoded = [np.array(Image.open(io.BytesIO(png)).convert("RGB")) for png in pngs]
            pixels = adapter.materialize_for_trainer(
                decoded, [i.descriptor for i in prompt.images], loaded
            ).kwargs
            return messages, prompt.token_ids, prompt.mm_token_type_ids, pixels

        hold(-1)  # warm this mode's code paths, so the measurement holds only per-rollout state
        gc.collect()
        before = rss_bytes()
        held = [hold(r) for r in range(rollouts)]
        gc.collect()
        after = rss_bytes()
    print(json.dumps({"mode": mode, "bytes_per_rollout": (after - before) / rollouts, "rollouts": len(held)}))


# Enough rollouts that each mode's total dwarfs allocator noise, few enough to fit in memory (inline
# rollouts hold tens of MB each).
MEMORY_ROLLOUTS = {"refs": 256, "inline": 8}


def memory_figures(work: Path) -> dict:
    from rawmm.run.tiny import build_tiny_model

    # The preset's own max_pixels, so a 1280x720 screenshot keeps its real size (1288x728 after resize).
    model = build_tiny_model("qwen2_vl", work / "tiny-qwen2_vl-fullres", max_pixels=12845056)
    figures = {}
    for mode, rollouts in MEMORY_ROLLOUTS.items():
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-worker",
                mode,
                "--rollouts",
                str(rollouts),
                "--model",
                str(model),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        figures[mode] = json.loads(out.strip().splitlines()[-1])["bytes_per_rollout"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollouts", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", choices=("refs", "inline"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker, args.rollouts, args.model)
        return

    with tempfile.TemporaryDirectory(prefix="rawmm-bench-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        summary, engines = run_loop(args.steps, work / "run")
        wall = time.perf_counter() - started
        engine = engine_figures(summary, engines)
        trainer = replay_trainer(work / "run" / "run-config.yaml")
        memory = memory_figures(work)

    print(
        f"\n== rawmm RL step on the tiny Qwen2-VL (shapes-multiturn, {engine['steps']} steps, {wall:.1f}s wall) =="
    )
    print(f"rollout phase per step            {engine['rollout_s_per_step']:8.3f} s")
    print(
        f"  engine-side materialize         {engine['engine_materialize_s_per_step']:8.3f} s "
        f"({engine['engine_images_materialized'] / engine['steps']:.1f} images materialized of "
        f"{engine['images_sent_per_step']:.1f} refs sent; cache hit rate {engine['cache_hit_rate']:.0%})"
    )
    print(f"trainer step (in the run)         {engine['trainer_step_s']:8.3f} s")
    print(
        f"  trainer-side materialize        {trainer['materialize_s_per_step']:8.3f} s "
        f"({trainer['materialized_per_step']:.1f} images materialized of {trainer['images_per_step']:.1f} "
        "referenced, deduplicated)"
    )
    print(f"  forward/backward                {trainer['forward_backward_s_per_step']:8.3f} s")
    print(f"engine generated tokens/s         {engine['generated_tokens_per_s']:8.1f}")
    print(f"engine image refs served/s        {engine['image_refs_per_s']:8.1f}")
    print(f"trainer tokens/s (fwd+bwd)        {trainer['train_tokens_per_s']:8.1f}")
    print(f"trainer images materialized/s     {trainer['train_images_per_s']:8.1f}")
    share = trainer["materialize_s_per_step"] / (
        trainer["materialize_s_per_step"] + trainer["forward_backward_s_per_step"]
    )
    print(f"materialization share of training {share:8.1%}")
    refs, inline = memory["refs"], memory["inline"]
    print(
        f"\n== orchestrator memory per in-flight rollout ({TURNS} turns of {SCREEN[0]}x{SCREEN[1]} screenshots) =="
    )
    print(f"with raw image refs               {refs / 1024:10.1f} KiB")
    print(f"with inline pixels                {inline / 1024:10.1f} KiB")
    print(f"ratio inline / refs               {inline / max(refs, 1):10.1f} x")


if __name__ == "__main__":
    main()
