"""Turning a run config into a concrete local run, checking everything before any process starts.

- The output directory (`--output-dir`, default `runs/<name>-<timestamp>`) holds the effective config
  (`run-config.yaml`, what every process reads), one log per process and `summary.json`.
- A relative `shared_dir` is taken relative to the output directory, so every local run is
  self-contained; an absolute one is used as is. A shared directory that already holds rollouts or
  checkpoints is refused (a new run would mix with the old one's steps).
- `model.path: tiny:<preset>` builds the tiny random-weight checkpoint of that preset into the
  output directory (`<output-dir>/tiny-<preset>`); `tiny:<preset>?warmup=N` then fine-tunes it for N steps
  on the environment's answer format with random answers (`rawmm.run.warmup`), for environments that
  offer a `format_example`. Any other path must be a checkpoint directory or a hub id
  (`owner/name`): a missing directory is refused here, not by an engine minutes later.
- The environment's factory is resolved here (a registered name or `package.module:factory`) and its args
  bound to its signature, so an unknown name, an unimportable module or arguments it does not take stop the
  run before anything is written (the factory itself runs in the orchestrator).
- With no `inference.urls`, local replicas listen on 127.0.0.1 at `base_port`, `base_port + 1`, ...;
  metrics ports of 0 become free ports. Ports already in use are refused.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from rawmm.config import RunConfig
from rawmm.config.model_path import model_path_problem
from rawmm.contract.shared_dir import SharedDir

TINY_PREFIX = "tiny:"


class PlanError(ValueError):
    """The run cannot start; nothing was started."""


@dataclass(frozen=True)
class LocalRunPlan:
    config: RunConfig  # the effective config: absolute paths, concrete URLs and ports
    config_path: Path
    output_dir: Path
    engine_ports: tuple[int, ...]  # empty when the run uses external engines (inference.urls)
    tiny_preset: str | None  # the tiny checkpoint to build before starting, if any
    tiny_warmup_steps: int = 0  # format warm-up steps on the tiny checkpoint (tiny:<preset>?warmup=N)

    @property
    def logs_dir(self) -> Path:
        return self.output_dir / "logs"

    @property
    def summary_path(self) -> Path:
        return self.output_dir / "summary.json"


def plan_local_run(
    config: RunConfig, *, steps: int | None = None, output_dir: Path | None = None
) -> LocalRunPlan:
    """Check `config` and resolve it for this machine; writes nothing."""
    if steps is not None and steps < 1:
        raise PlanError(f"--steps must be at least 1, got {steps}")
    output_dir = (output_dir or Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    shared_dir = config.shared_dir if config.shared_dir.is_absolute() else output_dir / config.shared_dir
    _refuse_previous_run(shared_dir)
    _check_environment(config)

    model_path, tiny_preset, warmup_steps = _model_path(config, output_dir)
    engine_ports: tuple[int, ...] = ()
    if config.inference.urls:
        urls = list(config.inference.urls)
    else:
        first = config.inference.base_port
        engine_ports = tuple(range(first, first + config.inference.replicas))
        for port in engine_ports:
            _require_free(port, "engine replica (inference.base_port)")
        urls = [f"http://127.0.0.1:{port}" for port in engine_ports]
    retention = config.offload.retention
    if retention.enabled and retention.metrics_port:
        _require_free(retention.metrics_port, "GC process (offload.retention.metrics_port)")

    monitoring = config.monitoring.model_copy(
        update={
            "orchestrator_metrics_port": _metrics_port(
                config.monitoring.orchestrator_metrics_port, "monitoring.orchestrator_metrics_port"
            ),
            "trainer_metrics_port": _metrics_port(
                config.monitoring.trainer_metrics_port, "monitoring.trainer_metrics_port"
            ),
        }
    )
    if monitoring.orchestrator_metrics_port == monitoring.trainer_metrics_port:
        raise PlanError("monitoring: the orchestrator and the trainer need different metrics ports")
    if set(engine_ports) & {monitoring.orchestrator_metrics_port, monitoring.trainer_metrics_port}:
        raise PlanError("monitoring: a metrics port collides with an engine replica port")

    effective = config.model_copy(
        update={
            "shared_dir": shared_dir,
            "model": config.model.model_copy(update={"path": str(model_path)}),
            "inference": config.inference.model_copy(update={"urls": urls}),
            "trainer": config.trainer.model_copy(update={"steps": steps or config.trainer.steps}),
            "monitoring": monitoring,
        }
    )
    return LocalRunPlan(
        config=effective,
        config_path=output_dir / "run-config.yaml",
        output_dir=output_dir,
        engine_ports=engine_ports,
        tiny_preset=tiny_preset,
        tiny_warmup_steps=warmup_steps,
    )


def _model_path(config: RunConfig, output_dir: Path) -> tuple[Path | str, str | None, int]:
    path = config.model.path
    if not path.startswith(TINY_PREFIX):
        if (problem := model_path_problem(path)) is not None:
            raise PlanError(f"model.path {path}: {problem}")
        local = Path(path).expanduser()
        return (local.resolve(), None, 0) if local.exists() else (path, None, 0)
    from rawmm.run.tiny import TINY_PRESETS

    preset, _, options = path.removeprefix(TINY_PREFIX).partition("?")
    if preset not in TINY_PRESETS:
        raise PlanError(f"model.path {path!r}: tiny checkpoints exist for {list(TINY_PRESETS)}")
    if preset != config.model.preset:
        raise PlanError(f"model.path {path!r} does not match model.preset {config.model.preset!r}")
    warmup = _warmup_steps(path, options)
    if warmup:
        _check_format_warmup(config)
    return output_dir / f"tiny-{preset}", preset, warmup


def _warmup_steps(path: str, options: str) -> int:
    if not options:
        return 0
    name, _, value = options.partition("=")
    if name != "warmup" or not value.isdecimal() or int(value) < 1:
        raise PlanError(f"model.path {path!r}: the one option of a tiny checkpoint is ?warmup=<steps >= 1>")
    return int(value)


def _check_format_warmup(config: RunConfig) -> None:
    from rawmm.rl.envs import resolve_environment

    environment = config.orchestrator.environment.name
    if not callable(getattr(resolve_environment(environment), "format_example", None)):
        raise PlanError(
            f"model.path {config.model.path!r}: environment {environment!r} has no format_example "
            "to warm up on"
        )


def _check_environment(config: RunConfig) -> None:
    """Import the environment's factory and bind its args, without building it (that may write)."""
    import inspect

    from rawmm.rl.envs import EnvironmentLoadError, resolve_environment

    environment = config.orchestrator.environment
    try:
        factory = resolve_environment(environment.name)
    except EnvironmentLoadError as exc:
        raise PlanError(f"orchestrator.environment: {exc}") from None
    try:
        inspect.signature(factory).bind(**environment.args)
    except TypeError as exc:
        raise PlanError(
            f"orchestrator.environment: {environment.name!r} does not take args {environment.args}: {exc}"
        ) from None
    except ValueError:  # a callable without an inspectable signature: its call will tell
        pass


def _refuse_previous_run(shared_dir: Path) -> None:
    if SharedDir(shared_dir).holds_a_run():
        raise PlanError(
            f"shared_dir {shared_dir} already holds a run's rollouts or checkpoints; "
            "use a new --output-dir (or an empty shared_dir)"
        )


def _require_free(port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers bind: connections of an earlier run lingering in TIME_WAIT do not block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise PlanError(f"port {port} for the {what} is already in use") from None


def _metrics_port(port: int, field: str) -> int:
    if port:
        _require_free(port, field)
        return port
    return free_port()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
