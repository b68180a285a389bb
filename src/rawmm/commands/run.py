"""`rawmm run CONFIG [--steps N] [--output-dir DIR]`: the whole RL loop on this machine."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import FrameType

from rawmm.commands import CliError
from rawmm.commands.run_config import load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (rawmm.config.RunConfig)")
    parser.add_argument("--steps", type=int, help="training steps (default: trainer.steps)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where the effective config, logs and summary.json go, and the base of a relative "
        "shared_dir (default: runs/<name>-<timestamp>)",
    )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from rawmm.run import LocalRun, LocalRunFailed, PlanError, plan_local_run

    config = load_run_config(args.config)
    try:
        plan = plan_local_run(config, steps=args.steps, output_dir=args.output_dir)
    except PlanError as exc:
        raise CliError(str(exc)) from None
    local_run = LocalRun(plan)
    # `kill` and Ctrl-C end the run the same way: every child stopped, the summary written.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = local_run.run()
    except LocalRunFailed as exc:
        local_run.console.print(f"[red]rawmm run failed:[/] {exc}")
        local_run.console.print(f"summary: {plan.summary_path}")
        return 1
    except KeyboardInterrupt:
        local_run.console.print(f"interrupted; everything stopped. summary: {plan.summary_path}")
        return 130
    from rawmm.run.progress import outcome

    report = f"\nreport: {local_run.report_path}" if local_run.report_path else ""
    local_run.console.print(f"{outcome(summary)}\nsummary: {plan.summary_path}{report}", soft_wrap=True)
    return 0
