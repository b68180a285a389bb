"""`rawmm gc`: remove offload images unused for longer than a bound that no rollout batch still needs.

One pass: `rawmm gc --offload-root DIR [--shared-dir DIR] [--keep-steps N] [--older-than 24h] [--dry-run]`.
For a run: `rawmm gc --config RUN.yaml` takes the store, the shared directory and the bounds from the run
config (`offload.retention`); with `--watch` it runs a pass per checkpoint until the run's last step,
logging one JSON line per pass and serving the volume's usage on /metrics (`offload.retention.metrics_port`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rawmm.commands import CliError, exit_on_sigterm
from rawmm.commands.run_config import load_run_config

if TYPE_CHECKING:
    from rawmm.config import RetentionConfig, RunConfig
    from rawmm.rl.retention.watch import PassResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--offload-root", type=Path, metavar="DIR", help="the offload store to collect")
    source.add_argument(
        "--config", metavar="RUN.yaml", help="a run config: its store, shared_dir and retention"
    )
    parser.add_argument(
        "--shared-dir",
        type=Path,
        metavar="DIR",
        help="the run's shared directory: images of batches not yet trained are kept (without it, age alone decides)",
    )
    parser.add_argument(
        "--keep-steps", type=int, metavar="N", help="also keep the images of the last N trained steps"
    )
    parser.add_argument(
        "--older-than",
        metavar="DURATION",
        help="remove images unused for this long (90m, 24h, 7d; default 24h)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list what a pass would remove; change nothing"
    )
    parser.add_argument(
        "--watch", action="store_true", help="with --config: a pass per checkpoint until the last step"
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics in --watch mode")


def run(args: argparse.Namespace) -> int:
    from rawmm.config import RetentionConfig

    exit_on_sigterm()  # a pod stop ends it at once, as 143
    config = None
    if args.config is not None:
        if args.shared_dir is not None:
            raise CliError("with --config the shared directory is the run config's shared_dir")
        config = load_run_config(args.config)
        offload_root, shared_dir, retention = config.offload_dir, config.shared_dir, config.offload.retention
    else:
        offload_root, shared_dir, retention = args.offload_root, args.shared_dir, RetentionConfig()
    retention = _with_flags(retention, args)
    if not offload_root.is_dir():
        raise CliError(f"offload root {offload_root} is not a directory")
    if args.watch:
        if config is None:
            raise CliError("--watch needs --config (the run's last step and its retention settings)")
        if args.dry_run:
            raise CliError("--watch removes what it finds; list it with --dry-run without --watch")
        return _watch(config, retention, args.metrics_host)
    return _once(offload_root, shared_dir, retention, dry_run=args.dry_run)


def _with_flags(retention: RetentionConfig, args: argparse.Namespace) -> RetentionConfig:
    """`retention` with the --older-than / --keep-steps given, validated as the run config would be."""
    from pydantic import ValidationError

    flags = {"older_than": args.older_than, "keep_steps": args.keep_steps}
    try:
        return retention.model_validate(
            {**retention.model_dump(), **{k: v for k, v in flags.items() if v is not None}}
        )
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        raise CliError(
            f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg'].removeprefix('Value error, ')}"
        ) from None


def _pass(
    offload_root: Path, shared_dir: Path | None, retention: RetentionConfig, *, dry_run: bool
) -> PassResult:
    from rawmm.rl.retention.watch import run_pass

    try:
        return run_pass(
            offload_root,
            shared_dir,
            older_than=retention.older_than_seconds,
            keep_steps=retention.keep_steps,
            dry_run=dry_run,
        )
    except (OSError, ValueError) as exc:  # before anything was removed: the batches are read first
        raise CliError(f"nothing removed: cannot tell which images the run's batches need: {exc}") from None


def _once(offload_root: Path, shared_dir: Path | None, retention: RetentionConfig, *, dry_run: bool) -> int:
    if shared_dir is None:
        print("rawmm gc: no --shared-dir, so age alone decides (no batch keeps its images)", file=sys.stderr)
    result = _pass(offload_root, shared_dir, retention, dry_run=dry_run)
    report = result.report
    if dry_run:
        for path in report.removed_paths:
            print(f"would remove {path}")
    needed = f"; {report.kept_needed} kept for batches not yet trained" if result.needed else ""
    print(
        f"{'would remove' if dry_run else 'removed'} {report.removed_files} images "
        f"({_size(report.removed_bytes)}) and {report.temps_removed} stale temp files "
        f"({_size(report.temp_bytes)}){needed}; {report.remaining_files} images "
        f"({_size(report.remaining_bytes)}) remain; {report.seconds:.2f}s"
    )
    return 0


def _watch(config: RunConfig, retention: RetentionConfig, metrics_host: str) -> int:
    from prometheus_client import start_http_server

    from rawmm.rl.retention import metrics
    from rawmm.rl.retention.watch import watch

    if retention.metrics_port:
        start_http_server(retention.metrics_port, addr=metrics_host)

    def on_pass(result: PassResult) -> None:
        metrics.export(result.report, config.offload_dir)
        print(json.dumps(result.event(), sort_keys=True), flush=True)

    def on_error(exc: Exception) -> None:
        print(json.dumps({"event": "gc_error", "error": f"{type(exc).__name__}: {exc}"}), flush=True)

    watch(
        config.offload_dir,
        config.shared_dir,
        older_than=retention.older_than_seconds,
        keep_steps=retention.keep_steps,
        final_step=config.trainer.steps,
        on_pass=on_pass,
        on_error=on_error,
    )
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
