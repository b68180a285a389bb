"""`rawmm run`: the whole loop on one machine, as local processes on one shared directory.

The engines (`rawmm serve`, one per replica), the trainer (`rawmm train`) and the orchestrator (`rawmm
orchestrate`) start together, so their start-ups overlap: the orchestrator waits for the engines' `/health`
itself, and an engine not healthy within its start timeout fails the run. The run is done when the trainer
and the orchestrator exit 0. It fails, stopping everything, when the orchestrator or the trainer exits non-zero, or when
the last engine replica exits (while others live, a dead replica is reported and the orchestrator
fails over). Ctrl-C stops everything as well. In every case the engines are scraped one last time,
every process group is stopped (no orphans) and `summary.json` is written. Should `rawmm run` itself be
killed (SIGKILL, OOM), its watchdog process stops every group instead (`rawmm.run.watchdog`).
Local engines open weight updates only to a token generated for this run (`$RAWMM_WEIGHTS_TOKEN`, given to
the engines and the orchestrator, and to the trainer when it broadcasts the weights itself,
`trainer.weight_transfer: broadcast`) and only from the run's checkpoint directory (`--weights-root`).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live

from rawmm.config.serve_argv import serve_argv
from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV, new_token
from rawmm.run.plan import LocalRunPlan
from rawmm.run.processes import ChildProcess, Watchdog, rawmm_argv, stop_all
from rawmm.run.progress import render, step_line
from rawmm.run.report.data import TIMELINE_NAME
from rawmm.run.scrape import health_version, scrape
from rawmm.run.state import RunState

log = logging.getLogger(__name__)


class LocalRunFailed(RuntimeError):
    """The run stopped before finishing; the message says which process and why."""


class LocalRun:
    def __init__(
        self,
        plan: LocalRunPlan,
        *,
        console: Console | None = None,
        tick_s: float = 0.5,
        engine_start_timeout_s: float = 300.0,
        on_finished: Callable[[LocalRun], None] | None = None,
    ) -> None:
        self.plan = plan
        self.console = console or Console(stderr=True)
        self.tick_s = tick_s
        self.engine_start_timeout_s = engine_start_timeout_s
        self.on_finished = on_finished  # called after the run ends, before anything is stopped
        config = plan.config
        self.state = RunState(engine_urls=list(config.inference.urls))
        self.engines = [
            ChildProcess(
                f"engine-{i}",
                rawmm_argv(*serve_argv(config, host="127.0.0.1", port=port)),
                plan.logs_dir / f"engine-{i}.log",
            )
            for i, port in enumerate(plan.engine_ports)
        ]
        self.orchestrator = ChildProcess(
            "orchestrator",
            rawmm_argv(
                "orchestrate", str(plan.config_path), "--metrics-host", "127.0.0.1",
                "--engine-down-timeout", str(engine_start_timeout_s),
            ),
            plan.logs_dir / "orchestrator.log",
        )  # fmt: skip
        self.trainer = ChildProcess(
            "trainer",
            rawmm_argv("train", str(plan.config_path), "--metrics-host", "127.0.0.1"),
            plan.logs_dir / "trainer.log",
        )
        # Retention: GC passes between steps in their own process (rawmm gc --watch); its log shows each pass.
        self.gc = (
            ChildProcess(
                "gc",
                rawmm_argv("gc", "--config", str(plan.config_path), "--watch", "--metrics-host", "127.0.0.1"),
                plan.logs_dir / "gc.log",
            )
            if config.offload.retention.enabled
            else None
        )
        self.children = [*self.engines, self.trainer, self.orchestrator, *([self.gc] if self.gc else [])]
        # Local engines open weight updates to this run's orchestrator only; external engines (inference.urls)
        # have their own token, which the orchestrator inherits from this process's environment.
        self._weights_env = {WEIGHTS_TOKEN_ENV: new_token()} if self.engines else {}
        self._started = time.monotonic()
        self._reported_dead: set[str] = set()
        self._healthy: set[str] = set()
        self.report_path: Path | None = None  # report.html, once written at the end of the run
        self._timeline_seen: set[tuple[str, int]] = set()

    @property
    def orchestrator_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.plan.config.monitoring.orchestrator_metrics_port}/metrics"

    @property
    def trainer_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.plan.config.monitoring.trainer_metrics_port}/metrics"

    def run(self) -> dict[str, Any]:
        """Run to the end; returns the summary (also written to summary.json). Raises `LocalRunFailed`
        (or KeyboardInterrupt) after writing the summary if the run did not finish."""
        self._prepare()
        self._started = time.monotonic()
        self._watchdog = Watchdog()
        status, error = "completed", None
        try:
            with httpx.Client(timeout=2.0) as http, self._live() as live:
                # All at once: the orchestrator waits for the engines itself, the trainer needs none,
                # and their start-up (imports, model loading) overlaps.
                for child in self.children:
                    self._watchdog.watch(
                        child.start(self._weights_env if self._updates_weights(child) else None)
                    )
                while not self._finished():
                    self._tick(http, live)
                    time.sleep(self.tick_s)
                self._tick(http, live)
        except LocalRunFailed as exc:
            status, error = "failed", str(exc)
            raise
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted (Ctrl-C)"
            raise
        except Exception as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if not self.console.is_terminal:
                self.console.line()  # Live leaves its last frame unterminated on a non-terminal console
            self._finish(status, error)
        return json.loads(self.plan.summary_path.read_text())

    def _updates_weights(self, child: ChildProcess) -> bool:
        """Whether `child` gets the weights token: the engines and whoever updates their weights (the
        orchestrator, or the trainer with `trainer.weight_transfer: broadcast`)."""
        return child is not self.trainer or self.plan.config.trainer.weight_transfer == "broadcast"

    def _prepare(self) -> None:
        plan = self.plan
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        plan.logs_dir.mkdir(exist_ok=True)
        if plan.tiny_preset is not None and not Path(plan.config.model.path).exists():
            from rawmm.run.tiny import build_tiny_model

            self.console.print(f"building the tiny {plan.tiny_preset} checkpoint at {plan.config.model.path}")
            build_tiny_model(plan.tiny_preset, Path(plan.config.model.path))
            if plan.tiny_warmup_steps:
                self._format_warmup()
        for directory in (plan.config.offload_dir, plan.config.rollouts_dir, plan.config.checkpoints_dir):
            directory.mkdir(parents=True, exist_ok=True)
        plan.config.to_yaml(plan.config_path)
        self.console.print(f"rawmm run: output in {plan.output_dir}")

    def _format_warmup(self) -> None:
        from rawmm.rl.envs import load_environment
        from rawmm.run.warmup import WarmupSettings, format_warmup

        config = self.plan.config
        environment = config.orchestrator.environment
        settings = WarmupSettings(
            steps=self.plan.tiny_warmup_steps,
            seed=config.trainer.seed,
            max_turns=config.orchestrator.max_turns,
        )
        self.console.print(
            f"format warm-up: {settings.steps} supervised steps on {environment.name}'s answer format, "
            "random answers"
        )
        started = time.monotonic()
        losses = format_warmup(
            Path(config.model.path), load_environment(environment.name, environment.args), settings
        )
        self.console.print(
            f"format warm-up: loss {losses[0]:.3g} -> {losses[-1]:.3g} in {time.monotonic() - started:.0f}s"
        )

    def _live(self) -> Live:
        return Live(
            self._view(), console=self.console, auto_refresh=False, transient=False,
            redirect_stdout=False, redirect_stderr=False,
        )  # fmt: skip

    def _view(self) -> Any:
        return render(
            self.state, self.children, steps=self.plan.config.trainer.steps,
            elapsed_s=time.monotonic() - self._started,
        )  # fmt: skip

    def _check_engines_started(self, http: httpx.Client) -> None:
        """Fail the run when a local replica is not healthy `engine_start_timeout_s` after its start."""
        for engine, url in zip(self.engines, self.state.engine_urls, strict=False):
            if url in self._healthy:
                continue
            if health_version(http, url) is not None:
                self._healthy.add(url)
            elif time.monotonic() - self._started > self.engine_start_timeout_s and engine.poll() is None:
                raise LocalRunFailed(
                    f"{engine.name} not healthy after {self.engine_start_timeout_s:.0f}s; "
                    f"last lines of {engine.log_path}:\n{engine.log_tail()}"
                )

    def _finished(self) -> bool:
        for child in (self.orchestrator, self.trainer):
            code = child.poll()
            if code not in (None, 0):
                raise LocalRunFailed(self._exit_message(child))
        for engine in self.engines:
            if engine.poll() is not None and not any(e.poll() is None for e in self.engines):
                raise LocalRunFailed(self._exit_message(engine, "(no engine replica left)"))
        return self.orchestrator.poll() == 0 and self.trainer.poll() == 0

    def _tick(self, http: httpx.Client, live: Live) -> None:
        self._check_engines_started(http)
        events = []
        for child in (self.orchestrator, self.trainer):
            for line in child.new_log_lines():
                event = self.state.read_line(line)
                if event is not None:
                    events.append(event)
                    if not self.console.is_terminal:
                        self.console.print(step_line(event), soft_wrap=True)
        for engine, url in zip(self.engines, self.state.engine_urls, strict=False):
            if engine.poll() is not None and url not in self._reported_dead:
                self._reported_dead.add(url)
                message = self._exit_message(engine)
                self.state.warnings.append(message)
                self.console.print(f"[red]{message}[/]")
        self._scrape(http)
        self._record_timeline(events)
        live.update(self._view(), refresh=True)

    def _record_timeline(self, events: list[dict[str, Any]]) -> None:
        """One line per step event with the run's clock and the engines' cache counters as just scraped:
        the engines' counters are cumulative, so the report takes per-step hit rates from differences."""
        fresh = [e for e in events if (e["event"], e["step"]) not in self._timeline_seen]
        if not fresh:
            return
        elapsed = round(time.monotonic() - self._started, 3)
        with (self.plan.output_dir / TIMELINE_NAME).open("a") as timeline:
            for event in fresh:
                self._timeline_seen.add((event["event"], event["step"]))
                entry = {
                    "event": event["event"],
                    "step": event["step"],
                    "elapsed_seconds": elapsed,
                    "cache_hits": self.state.cache_hits,
                    "cache_misses": self.state.cache_misses,
                }
                timeline.write(json.dumps(entry) + "\n")

    def _scrape(self, http: httpx.Client) -> None:
        for url in self.state.engine_urls:
            if (found := scrape(http, f"{url}/metrics")) is not None:
                self.state.engines[url] = found
        if (found := scrape(http, self.orchestrator_metrics_url)) is not None:
            self.state.orchestrator = found
        if (found := scrape(http, self.trainer_metrics_url)) is not None:
            self.state.trainer = found

    def _finish(self, status: str, error: str | None) -> None:
        try:
            with httpx.Client(timeout=2.0) as http:
                self._scrape(http)
                for url in self.state.engine_urls:
                    self.state.engine_versions[url] = health_version(http, url)
            for child in (self.orchestrator, self.trainer):
                for line in child.new_log_lines():
                    self.state.read_line(line)
            if self.on_finished is not None:
                self.on_finished(self)
        finally:
            self._stop_children()
            summary = self.state.summary(
                status=status,
                error=error,
                steps=self.plan.config.trainer.steps,
                shared_dir=self.plan.config.shared_dir,
                output_dir=self.plan.output_dir,
                wall_seconds=time.monotonic() - self._started,
            )
            self.plan.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
            self._write_report()

    def _write_report(self) -> None:
        """report.html and plots/ from what the run left on disk; a run never fails on its report."""
        try:
            from rawmm.run.report import build_report

            self.report_path = build_report(self.plan.output_dir)
        except ModuleNotFoundError as exc:  # matplotlib is the report extra's
            self.console.print(f"no report: {exc} (pip install 'rawmm[report]', then rawmm report DIR)")
        except Exception as exc:  # noqa: BLE001 - the summary is written; the report is a view of it
            log.exception("writing the run report failed")
            self.console.print(f"[red]no report:[/] {type(exc).__name__}: {exc}")

    def _stop_children(self) -> None:
        # A second Ctrl-C (or SIGTERM) while stopping must not cut the shutdown short and leave orphans.
        signals = (signal.SIGINT, signal.SIGTERM)
        in_main = threading.current_thread() is threading.main_thread()
        previous = [signal.signal(s, signal.SIG_IGN) for s in signals] if in_main else []
        try:
            stop_all(self.children)
            self._watchdog.release()
        finally:
            for sig, handler in zip(signals, previous, strict=False):
                signal.signal(sig, handler)

    def _exit_message(self, child: ChildProcess, context: str = "") -> str:
        code = child.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        tail = child.log_tail()
        return (
            f"{child.name} {how}{' ' + context if context else ''}; last lines of {child.log_path}:\n{tail}"
        )
