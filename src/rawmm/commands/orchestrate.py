"""`rawmm orchestrate CONFIG`: play rollouts against the run's engine replicas and ship training batches."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from rawmm.commands import CliError, exit_on_sigterm
from rawmm.commands.run_config import load_run_config, steps_to_run

if TYPE_CHECKING:
    from rawmm.config import RunConfig
    from rawmm.rl.envs import Environment
    from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
    from rawmm.rl.orchestrator.rollout import PromptRenderer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (rawmm.config.RunConfig)")
    parser.add_argument("--steps", type=int, help="steps to run (default: trainer.steps)")
    parser.add_argument(
        "--engine-down-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long to wait for engine replicas to come up (at start, or when all are down) before "
        "failing (default 600)",
    )
    parser.add_argument(
        "--checkpoint-timeout",
        type=float,
        metavar="SECONDS",
        help="fail if the trainer's checkpoint a step waits for does not appear within this time "
        "(default: orchestrator.checkpoint_timeout_seconds)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address of the /metrics endpoint (port: monitoring section)",
    )


def run(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from rawmm.contract import OffloadStore
    from rawmm.rl.envs import EnvironmentLoadError, load_environment
    from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
    from rawmm.rl.orchestrator.rollout import PromptRenderer

    exit_on_sigterm()  # a pod stop ends it at once, as 143
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    config = load_run_config(args.config)
    if not config.inference.urls:
        raise CliError("inference.urls is empty: give the engine replicas' URLs (`rawmm run` fills them in)")
    steps = steps_to_run(args.steps, config)
    env_cfg = config.orchestrator.environment
    try:
        environment = load_environment(env_cfg.name, env_cfg.args)
    except EnvironmentLoadError as exc:
        raise CliError(f"orchestrator.environment: {exc}") from None
    try:
        renderer = PromptRenderer(
            config.model.path,
            config.model.preset,
            config.model.backend,
            OffloadStore(config.offload_dir),
        )
    except OSError as exc:
        raise CliError(
            f"model.path {config.model.path!r}: cannot load its tokenizer and processor config: {exc}"
        ) from None
    metrics = OrchestratorMetrics()
    port = config.monitoring.orchestrator_metrics_port
    if port:
        start_http_server(port, addr=args.metrics_host, registry=metrics.registry)
    return asyncio.run(
        _orchestrate(
            config,
            steps,
            environment,
            renderer,
            metrics,
            args.engine_down_timeout,
            args.checkpoint_timeout or config.orchestrator.checkpoint_timeout_seconds,
        )
    )


async def _orchestrate(
    config: RunConfig,
    steps: int,
    environment: Environment,
    renderer: PromptRenderer,
    metrics: OrchestratorMetrics,
    down_timeout_s: float,
    checkpoint_timeout_s: float,
) -> int:
    import httpx

    from rawmm.contract.shared_dir import CheckpointTimeout
    from rawmm.rl.orchestrator.engine_client import EngineClient
    from rawmm.rl.orchestrator.loop import AllRolloutsDropped, Orchestrator, print_report
    from rawmm.rl.orchestrator.replicas import NoReplicaAvailable, ReplicaPool
    from rawmm.rl.samples import SampleError

    timeout = httpx.Timeout(600.0, connect=5.0)  # a CPU engine under a full step of rollouts is slow
    async with httpx.AsyncClient(timeout=timeout) as http:
        pool = ReplicaPool(
            config.inference.urls, EngineClient(http, metrics), metrics, down_timeout_s=down_timeout_s
        )
        orchestrator = Orchestrator(
            config,
            pool=pool,
            renderer=renderer,
            environment=environment,
            metrics=metrics,
            checkpoint_timeout_s=checkpoint_timeout_s,
        )
        try:
            await orchestrator.run(steps, on_step=print_report)
        except (NoReplicaAvailable, AllRolloutsDropped, SampleError, CheckpointTimeout) as exc:
            raise CliError(str(exc)) from None
        finally:
            await pool.close()
    return 0
