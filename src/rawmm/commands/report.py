"""`rawmm report RUN_DIR`: (re)build a run's report.html and plots from its output directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from rawmm.commands import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="a `rawmm run` output directory, live or finished")


def run(args: argparse.Namespace) -> int:
    from rawmm.run.report import build_report

    try:
        path = build_report(args.run_dir)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0
