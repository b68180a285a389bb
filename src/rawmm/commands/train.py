"""`rawmm train CONFIG`: train on the run's rollout batches and write a checkpoint per step.

Launched by torchrun (`torchrun --nproc-per-node N -m rawmm.cli train CONFIG`) it trains on N ranks,
data-parallel or FSDP-sharded as `trainer.parallelism` says; it resumes after the newest checkpoint.
"""

from __future__ import annotations

import argparse
import logging

from rawmm.commands import CliError, exit_on_sigterm
from rawmm.commands.run_config import load_run_config, steps_to_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (rawmm.config.RunConfig)")
    parser.add_argument("--steps", type=int, help="train up to this step (default: trainer.steps)")
    parser.add_argument(
        "--batch-timeout",
        type=float,
        metavar="SECONDS",
        help="fail if a step's rollout batch does not appear within this time "
        "(default: trainer.batch_timeout_seconds)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address of the /metrics endpoint (port: monitoring section)",
    )


def run(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from rawmm.contract.shared_dir import BatchTimeout
    from rawmm.rl.trainer.distributed import init_distributed, shutdown_distributed
    from rawmm.rl.trainer.loop import Trainer, step_log_line
    from rawmm.rl.trainer.materializer import MissingImageError
    from rawmm.rl.trainer.train_state import MissingTrainState

    exit_on_sigterm()  # a pod stop ends it at once, as 143
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    config = load_run_config(args.config)
    steps = steps_to_run(args.steps, config)
    dist = init_distributed()
    try:
        try:
            trainer = Trainer(config, dist)
        except MissingTrainState as exc:
            raise CliError(f"cannot resume: {exc}") from None
        except (OSError, ValueError) as exc:
            raise CliError(
                f"model.path {config.model.path!r}: cannot load the model or its processor: {exc}"
            ) from None
        port = config.monitoring.trainer_metrics_port
        if dist.is_main and port:
            start_http_server(port, addr=args.metrics_host)
        trainer.run(
            steps,
            batch_timeout=args.batch_timeout or config.trainer.batch_timeout_seconds,
            on_step=(lambda result: print(step_log_line(result), flush=True)) if dist.is_main else None,
        )
    except (BatchTimeout, MissingImageError) as exc:
        raise CliError(str(exc)) from None
    finally:
        shutdown_distributed()
    return 0
