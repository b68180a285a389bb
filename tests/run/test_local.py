"""`rawmm run`: planning checks, the supervisor with stand-in processes (fast), and real end-to-end runs
on the tiny model (slow)."""

from __future__ import annotations

import _thread
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from ports import free_port

from rawmm.cli import main
from rawmm.config import RunConfig
from rawmm.config.serve_argv import serve_argv
from rawmm.run import LocalRun, LocalRunFailed, PlanError, plan_local_run
from rawmm.run.processes import rawmm_argv
from rawmm.run.state import SUMMARY_KEYS

BASE = {
    "name": "t",
    "model": {"path": "tiny:qwen2_vl", "preset": "qwen2_vl"},
    "shared_dir": "shared",
    "monitoring": {"orchestrator_metrics_port": 0, "trainer_metrics_port": 0},
}


def config(**overrides) -> RunConfig:
    data = json.loads(json.dumps(BASE))
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return RunConfig.model_validate(data)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (it only waits for its parent to reap it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# --- planning: every check happens before anything starts -------------------------------------------


def test_plan_resolves_paths_ports_and_the_tiny_model(tmp_path):
    port = free_port(2)
    plan = plan_local_run(
        config(inference__base_port=port, inference__replicas=2), steps=3, output_dir=tmp_path
    )
    effective = plan.config
    assert effective.shared_dir == tmp_path / "shared"
    assert effective.model.path == str(tmp_path / "tiny-qwen2_vl") and plan.tiny_preset == "qwen2_vl"
    assert effective.inference.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert plan.engine_ports == (port, port + 1)
    assert effective.trainer.steps == 3
    ports = {effective.monitoring.orchestrator_metrics_port, effective.monitoring.trainer_metrics_port}
    assert 0 not in ports and len(ports) == 2
    assert not tmp_path.joinpath("run-config.yaml").exists()  # planning writes nothing


def test_plan_takes_the_format_warm_up_of_a_tiny_checkpoint(tmp_path):
    plan = plan_local_run(
        config(
            model={"path": "tiny:qwen2_vl?warmup=7", "preset": "qwen2_vl"},
            orchestrator={"environment": {"name": "colours", "args": {"colours": 3}}},
            inference__base_port=free_port(),
        ),
        output_dir=tmp_path,
    )
    assert (plan.tiny_preset, plan.tiny_warmup_steps) == ("qwen2_vl", 7)
    assert plan.config.model.path == str(tmp_path / "tiny-qwen2_vl")
    plain = config(inference__base_port=free_port())
    assert plan_local_run(plain, output_dir=tmp_path / "plain").tiny_warmup_steps == 0


def test_local_engines_run_the_command_line_the_operator_gives_its_pods(tmp_path):
    """One builder for both (`rawmm.config.serve_argv`): a local replica differs from a pod only in its address."""
    port = free_port(2)
    plan = plan_local_run(
        config(inference__base_port=port, inference__replicas=2, inference__materialize_cache_size="64Mi"),
        output_dir=tmp_path,
    )
    run = LocalRun(plan)
    assert [engine.argv for engine in run.engines] == [
        rawmm_argv(*serve_argv(plan.config, host="127.0.0.1", port=p)) for p in (port, port + 1)
    ]
    assert "64Mi" in run.engines[0].argv


def test_plan_keeps_an_absolute_shared_dir_and_external_engines(tmp_path):
    plan = plan_local_run(
        config(shared_dir=str(tmp_path / "elsewhere"), inference__urls=["http://10.1.2.3:8000"]),
        output_dir=tmp_path / "out",
    )
    assert plan.config.shared_dir == tmp_path / "elsewhere"
    assert plan.engine_ports == () and plan.config.inference.urls == ["http://10.1.2.3:8000"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": {"path": "tiny:qwen3_vl", "preset": "qwen2_vl"}}, "does not match model.preset"),
        ({"model": {"path": "tiny:qwen2_5_vl", "preset": "qwen2_5_vl"}}, "tiny checkpoints exist for"),
        ({"model": {"path": "tiny:qwen2_vl?warmup=0", "preset": "qwen2_vl"}}, r"\?warmup=<steps >= 1>"),
        ({"model": {"path": "tiny:qwen2_vl?steps=3", "preset": "qwen2_vl"}}, r"\?warmup=<steps >= 1>"),
        # shapes-multiturn (the default environment) offers no format_example to warm up on
        ({"model": {"path": "tiny:qwen2_vl?warmup=5", "preset": "qwen2_vl"}}, "no format_example"),
    ],
)
def test_plan_refuses_unusable_settings(tmp_path, overrides, message):
    with pytest.raises(PlanError, match=message):
        plan_local_run(config(**overrides), output_dir=tmp_path)


def test_plan_refuses_busy_ports_and_a_used_shared_dir(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PlanError, match=f"port {port} for the engine replica"):
            plan_local_run(config(inference__base_port=port), output_dir=tmp_path)
        # The engine's port must be free here, whatever else runs on this machine (a demo on 8100).
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            engine_port = spare.getsockname()[1]
        with pytest.raises(PlanError, match=f"port {port} for the monitoring.trainer_metrics_port"):
            plan_local_run(
                config(inference__base_port=engine_port, monitoring__trainer_metrics_port=port),
                output_dir=tmp_path,
            )
    (tmp_path / "shared" / "checkpoints").mkdir(parents=True)
    (tmp_path / "shared" / "checkpoints" / "latest").write_text("2\n")
    with pytest.raises(PlanError, match="already holds a run"):
        plan_local_run(config(inference__base_port=engine_port), output_dir=tmp_path)


def test_bad_config_is_one_clear_error_and_starts_nothing(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, "trainer": {"steps": 0, "learnig_rate": 1}}))
    out = tmp_path / "out"
    assert main(["run", str(path), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "trainer.steps" in err and "trainer.learnig_rate: unknown field" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            # Refused by the run config itself (the operator refuses it the same way).
            {"orchestrator": {"environment": {"name": "no-such-env"}}},
            "invalid run config: orchestrator.environment: unknown environment 'no-such-env': use one of",
        ),
        (
            {"orchestrator": {"environment": {"name": "no_pkg.mod:Cls"}}},
            "orchestrator.environment: environment 'no_pkg.mod:Cls': cannot import 'no_pkg.mod'",
        ),
        (
            {"orchestrator": {"environment": {"name": "shapes", "args": {"no_such_arg": 1}}}},
            "orchestrator.environment: 'shapes' does not take args {'no_such_arg': 1}",
        ),
        (
            {"model": {"path": "/nonexistent", "preset": "qwen2_vl"}},
            "model.path /nonexistent: no such directory",
        ),
    ],
)
def test_an_unusable_environment_or_model_path_stops_the_run_before_anything_is_written(
    tmp_path, capsys, overrides, message
):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, **overrides}))
    out = tmp_path / "out"
    assert main(["run", str(path), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rawmm run: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()  # no output dir, no tiny model, no process


def test_a_yaml_syntax_error_stops_the_run_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel: {path: tiny:qwen2_vl\n")
    assert main(["run", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rawmm run: error: {path}:3:1: not valid YAML: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# --- the live view: every number on an 80-column console, nothing wrapped or cut ------------------------


def test_progress_and_step_lines_fit_80_columns_with_every_number(tmp_path):
    from rich.console import Console

    from rawmm.run.processes import ChildProcess
    from rawmm.run.progress import outcome, render, step_line
    from rawmm.run.scrape import parse_metrics
    from rawmm.run.state import RunState

    state = RunState(engine_urls=["http://127.0.0.1:8100", "http://127.0.0.1:8101"])
    engine_metrics = parse_metrics(
        "rawmm_materialize_cache_hits_total 300\nrawmm_materialize_cache_misses_total 100\n"
        'rawmm_invalid_mm_image_ref_total{reason="missing_file"} 12\nrawmm_engine_weights_version 123\n'
    )
    state.engines = dict.fromkeys(state.engine_urls, engine_metrics)
    # Wide values everywhere: three-digit steps, four-digit counts, exponents, an exit code.
    orchestrator = {"event": "orchestrator_step", "step": 123, "reward_mean": 0.0520833, "rollouts": 128,
                    "samples": 384, "images_sent": 1234, "dropped": {"invalid_mm_image_ref": 4}}  # fmt: skip
    trainer = {"event": "trainer_step", "step": 122, "reward_mean": 0.0520833, "loss": -1.23456e-05,
               "grad_norm": 0.12345, "tokens": 123456, "images_materialized": 1234, "missing_images": 12}  # fmt: skip
    for event in (orchestrator, trainer):
        state.read_line(json.dumps(event))
    children = [
        ChildProcess(name, [], tmp_path / name)
        for name in ("engine-0", "engine-1", "trainer", "orchestrator")
    ]
    for child, code in zip(children, (0, 137, 0, 0), strict=True):
        child.popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        child.popen.wait()

    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(state, children, steps=1000, elapsed_s=12345))
    table = console.export_text()
    lines = table.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in table
    assert lines[0].startswith("rawmm run: step 122/1000, 12345s")
    (orchestrator_row,) = [line.split() for line in lines if line.startswith("orchestrator")]
    assert orchestrator_row == [
        "orchestrator",
        "done",
        "123",
        "0.05208",
        "-",
        "128",
        "rollouts,",
        "4",
        "dropped",
    ]
    (trainer_row,) = [line.split() for line in lines if line.startswith("trainer")]
    assert trainer_row == [
        "trainer",
        "done",
        "122",
        "0.05208",
        "-1.23e-05",
        "1234",
        "images,",
        "12",
        "missing",
    ]
    engine_rows = [line.split() for line in lines if line.startswith("engine :")]
    assert engine_rows == [
        ["engine", ":8100", "done", "75%", "12", "v123"],
        ["engine", ":8101", "exited", "137", "75%", "12", "v123"],
    ]
    assert step_line(orchestrator) == (
        "orchestrator step 123: reward=0.05208 rollouts=128 dropped=4 (invalid_mm_image_ref=4) samples=384 "
        "image_refs=1234"
    )
    assert step_line(trainer) == (
        "trainer step 122: loss=-1.235e-05 grad_norm=0.123 tokens=123456 images=1234 missing=12"
    )
    summary = {"steps_completed": 2, "wall_seconds": 61.7, "cache_hit_rate": 0.865, "invalid_mm_image_refs": 0,
               "reward_mean": [0.0169, 0.0781], "loss": [-0.0504, -0.1208], "grad_norm": [0.767, 0.681]}  # fmt: skip
    assert outcome(summary).splitlines() == [
        "done: 2 steps in 62s, cache hit rate 86%, invalid refs 0",
        "  reward per step         0.0169     0.0781",
        "  loss per step          -0.0504    -0.1208",
        "  grad norm per step       0.767      0.681",
    ]


# --- the supervisor, with stand-in processes ----------------------------------------------------------

FAKE_ENGINE = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys
    port, pid_file = int(sys.argv[1]), sys.argv[2]
    if "FAKE_TOKEN_DIR" in os.environ:
        open(os.path.join(os.environ["FAKE_TOKEN_DIR"], "engine"), "w").write(os.environ.get("RAWMM_WEIGHTS_TOKEN", ""))
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # Written whole or not at all (renamed into place): a reader never sees it empty, even if we are killed.
    with open(pid_file + ".tmp", "w") as out:
        out.write(str(helper.pid))
    os.replace(pid_file + ".tmp", pid_file)
    METRICS = (
        "rawmm_materialize_cache_hits_total 30\\nrawmm_materialize_cache_misses_total 10\\n"
        'rawmm_invalid_mm_image_ref_total{reason="missing_file"} 0\\nrawmm_engine_weights_version 2\\n'
    )
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body, kind = json.dumps({"status": "ok", "weights_version": 2}), "application/json"
            else:
                body, kind = METRICS, "text/plain"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)

FAKE_STEPS = textwrap.dedent(
    """
    import json, os, sys, time, urllib.request
    event, steps, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if len(sys.argv) > 4:  # the orchestrator waits for its engine's /health, as the real one does
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(sys.argv[4], timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit("the engine never answered")
                time.sleep(0.05)
    if "FAKE_TOKEN_DIR" in os.environ:
        open(os.path.join(os.environ["FAKE_TOKEN_DIR"], event), "w").write(os.environ.get("RAWMM_WEIGHTS_TOKEN", ""))
    for step in range(1, steps + 1):
        line = {"event": event, "step": step, "reward_mean": 0.25 * step, "loss": 0.5 / step, "grad_norm": 2.0 * step,
                "rollouts": 8, "samples": 24, "images_sent": 48, "dropped": {}, "tokens": 100,
                "images_materialized": 6, "missing_images": 0}
        print(json.dumps(line), flush=True)
    if then == "hang":
        time.sleep(600)
    print("fake process ends with", then, file=sys.stderr, flush=True)
    sys.exit(int(then))
    """
)


@pytest.fixture
def fake_run(tmp_path):
    """A LocalRun whose engine, trainer and orchestrator are stand-in scripts."""
    (tmp_path / "engine.py").write_text(FAKE_ENGINE)
    (tmp_path / "steps.py").write_text(FAKE_STEPS)
    runs = []

    def make(trainer_then: str = "0", orchestrator_then: str = "0", **kwargs) -> LocalRun:
        plan = plan_local_run(
            config(model={"path": str(tmp_path), "preset": "qwen2_vl"}, inference__base_port=free_port()),
            output_dir=tmp_path / "out",
        )
        run = LocalRun(plan, tick_s=0.05, **kwargs)
        (port,) = plan.engine_ports
        run.engines[0].argv = [
            sys.executable,
            str(tmp_path / "engine.py"),
            str(port),
            str(tmp_path / "helper.pid"),
        ]
        run.trainer.argv = [sys.executable, str(tmp_path / "steps.py"), "trainer_step", "2", trainer_then]
        run.orchestrator.argv = [
            sys.executable,
            str(tmp_path / "steps.py"),
            "orchestrator_step",
            "2",
            orchestrator_then,
            f"http://127.0.0.1:{port}/health",
        ]
        runs.append(run)
        return run

    yield make
    for run in runs:
        for child in run.children:
            assert child.pid is None or not pid_alive(child.pid), f"{child.name} left running"
    helper = tmp_path / "helper.pid"
    if helper.exists():
        assert not pid_alive(int(helper.read_text())), "the engine's own child was orphaned"


def test_completed_run_writes_a_summary_of_steps_and_final_engine_metrics(fake_run):
    run = fake_run()
    summary = run.run()
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary == json.loads(run.plan.summary_path.read_text())
    assert summary["status"] == "completed" and summary["error"] is None
    assert summary["steps_completed"] == 2
    assert summary["reward_mean"] == [0.25, 0.5] and summary["loss"] == [0.5, 0.25]
    assert summary["grad_norm"] == [2.0, 4.0]
    assert (summary["cache_hits"], summary["cache_misses"], summary["cache_hit_rate"]) == (30, 10, 0.75)
    assert summary["invalid_mm_image_refs"] == 0 and summary["images_materialized_trainer"] == 12
    assert summary["engine_weights_version"] == {run.plan.config.inference.urls[0]: 2}
    assert RunConfig.from_yaml(run.plan.config_path) == run.plan.config


def test_local_engines_and_the_orchestrator_share_a_fresh_weights_token(fake_run, tmp_path, monkeypatch):
    seen = tmp_path / "tokens"
    seen.mkdir()
    monkeypatch.setenv("FAKE_TOKEN_DIR", str(seen))
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", "the caller's own")
    names = ("engine", "orchestrator_step", "trainer_step")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    run = fake_run(trainer_then="hang", orchestrator_then="hang")
    real_argv = LocalRun(run.plan).engines[0].argv  # fake_run swaps the command lines out
    assert real_argv[real_argv.index("--weights-root") + 1] == str(run.plan.config.checkpoints_dir)
    waiter = threading.Thread(target=lambda: _interrupt_when(lambda: all((seen / n).exists() for n in names)))
    waiter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    waiter.join()
    tokens = {name: (seen / name).read_text() for name in names}
    assert tokens["engine"] == tokens["orchestrator_step"] and len(tokens["engine"]) >= 40
    assert tokens["trainer_step"] == "the caller's own"  # the trainer gets no new token (it needs none)


def test_a_failing_trainer_stops_everything_and_says_why(fake_run):
    run = fake_run(trainer_then="3", orchestrator_then="hang")
    with pytest.raises(LocalRunFailed, match=r"(?s)trainer exited with code 3.*fake process ends with 3"):
        run.run()
    summary = json.loads(run.plan.summary_path.read_text())
    assert summary["status"] == "failed" and "trainer exited with code 3" in summary["error"]


def test_losing_the_only_engine_fails_the_run(fake_run):
    run = fake_run(trainer_then="hang", orchestrator_then="hang")
    killer = threading.Thread(target=lambda: _kill_when_started(run))
    killer.start()
    with pytest.raises(LocalRunFailed, match="engine-0 was killed by signal 9 .no engine replica left"):
        run.run()
    killer.join()


def _kill_when_started(run: LocalRun) -> None:
    event = threading.Event()
    while not (run.trainer.pid and run.orchestrator.pid) and not event.wait(0.02):
        pass
    os.killpg(run.engines[0].pid, 9)


def test_ctrl_c_stops_every_process_and_records_the_interruption(fake_run):
    # Ctrl-C as Python delivers it, whatever handler an earlier test's server left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    run = fake_run(trainer_then="hang", orchestrator_then="hang")
    interrupter = threading.Thread(target=lambda: _interrupt_after_first_step(run), daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupter.join(timeout=10)
    assert json.loads(run.plan.summary_path.read_text())["status"] == "interrupted"


def _interrupt_when(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition() and time.monotonic() < deadline and not threading.Event().wait(0.02):
        pass
    _thread.interrupt_main()


def _interrupt_after_first_step(run: LocalRun) -> None:
    event = threading.Event()
    deadline = time.monotonic() + 60
    while not run.state.trainer_steps and time.monotonic() < deadline and not event.wait(0.02):
        pass
    _thread.interrupt_main()


DRIVER = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    from rawmm.run import LocalRun
    from rawmm.run.plan import plan_local_run
    from rawmm.config import RunConfig

    work, config = Path(sys.argv[1]), RunConfig.model_validate_json(sys.argv[2])
    run = LocalRun(plan_local_run(config, output_dir=work / "out"), tick_s=0.05)
    (port,) = run.plan.engine_ports
    run.engines[0].argv = [sys.executable, str(work / "engine.py"), str(port), str(work / "helper.pid")]
    run.trainer.argv = [sys.executable, str(work / "steps.py"), "trainer_step", "1", "hang"]
    run.orchestrator.argv = [sys.executable, str(work / "steps.py"), "orchestrator_step", "1", "hang"]

    def report():
        while not all(child.pid for child in run.children):
            time.sleep(0.02)
        (work / "pids.tmp").write_text(json.dumps([child.pid for child in run.children]))
        (work / "pids.tmp").replace(work / "pids.json")  # whole or not at all for the test polling it

    threading.Thread(target=report, daemon=True).start()
    run.run()
    """
)


def test_sigkill_of_rawmm_run_stops_every_child_and_a_rerun_finds_its_port_free(tmp_path):
    (tmp_path / "engine.py").write_text(FAKE_ENGINE)
    (tmp_path / "steps.py").write_text(FAKE_STEPS)
    port = free_port()
    run_config = config(model={"path": str(tmp_path), "preset": "qwen2_vl"}, inference__base_port=port)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), run_config.model_dump_json()])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "pids.json").exists() and (tmp_path / "helper.pid").exists()):
            assert driver.poll() is None and time.monotonic() < deadline, "the run did not start"
            threading.Event().wait(0.02)
        pids = [*json.loads((tmp_path / "pids.json").read_text()), int((tmp_path / "helper.pid").read_text())]
        assert all(pid_alive(pid) for pid in pids)
        driver.kill()  # SIGKILL: no handler, no finally, no chance to stop anything itself
        driver.wait()
        deadline = time.monotonic() + 30
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        assert not [pid for pid in pids if pid_alive(pid)], (
            "engine, trainer, orchestrator or a grandchild survived"
        )
        plan_local_run(run_config, output_dir=tmp_path / "rerun")  # the engine port is free again
    finally:
        for pid in pids:  # whatever the outcome, nothing of this test outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


# --- end to end on the tiny model (real engine, orchestrator and trainer processes) ---------------------

ENVS_DIR = Path(__file__).parents[1] / "rl" / "envs"


def e2e_config(model: Path, **overrides) -> RunConfig:
    """The demo config, shrunk to the least work that still shows every behaviour (2 shared cores)."""
    data = yaml.safe_load((Path(__file__).parents[2] / "examples" / "local-tiny.yaml").read_text())
    data["model"]["path"] = str(model)
    data["inference"]["base_port"] = free_port()
    small = {"prompts_per_step": 1, "rollouts_per_prompt": 2, "max_turns": 2, "max_tokens": 4}
    data["orchestrator"].update(small)
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    return RunConfig.model_validate(data)


def assert_all_stopped(run: LocalRun) -> None:
    for child in run.children:
        assert child.pid is not None and not pid_alive(child.pid), f"{child.name} is still running"


@pytest.mark.slow
def test_two_step_run_matches_its_metrics_and_ends_on_the_last_weights(tmp_path, tiny_qwen2_vl):
    import httpx

    from rawmm.rl.batches import read_batch
    from rawmm.run.scrape import health_version, scrape

    live: dict = {}

    def check_live_endpoints(run: LocalRun) -> None:
        with httpx.Client(timeout=5) as http:
            (url,) = run.plan.config.inference.urls
            live["metrics"], live["version"] = scrape(http, f"{url}/metrics"), health_version(http, url)

    # Enough rollouts and tokens for the example's partial reward to tell the random model's rollouts
    # apart (a reply holds a number about one time in three at 16 tokens).
    sized = {"rollouts_per_prompt": 4, "max_tokens": 16}
    plan = plan_local_run(e2e_config(tiny_qwen2_vl, orchestrator=sized), output_dir=tmp_path)
    run = LocalRun(plan, on_finished=check_live_endpoints)
    summary = run.run()
    assert_all_stopped(run)

    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    engine = live["metrics"]
    assert summary["cache_hits"] == engine.total("rawmm_materialize_cache_hits_total") > 0
    assert summary["cache_misses"] == engine.total("rawmm_materialize_cache_misses_total") > 0
    assert summary["invalid_mm_image_refs"] == engine.total("rawmm_invalid_mm_image_ref_total") == 0
    checkpoints = [Path(p) for p in summary["checkpoints"]]
    assert [p.name for p in checkpoints] == ["step_1", "step_2"]
    assert all(any(p.glob("*.safetensors")) for p in checkpoints)
    # The orchestrator had every replica load each new checkpoint, the last one included.
    (version,) = summary["engine_weights_version"].values()
    assert version == live["version"] == engine.value("rawmm_engine_weights_version") == 2
    assert len(summary["loss"]) == 2 and all(abs(loss) < float("inf") for loss in summary["loss"])
    assert len(summary["reward_mean"]) == 2
    trainer_lines = [
        json.loads(line) for line in run.trainer.log_path.read_text().splitlines() if line.startswith("{")
    ]
    assert summary["loss"] == [line["loss"] for line in trainer_lines]
    assert summary["grad_norm"] == [line["grad_norm"] for line in trainer_lines]
    # A learning signal: rewards differ within a group, so advantages and the gradient are not zero.
    advantages = [
        a
        for step in (1, 2)
        for sample in read_batch(plan.config.rollouts_dir, step).samples
        for a in sample.advantages
    ]
    assert any(a != 0 for a in advantages)
    assert any(norm > 0 for norm in summary["grad_norm"])
    assert (
        summary["images_materialized_trainer"]
        == sum(line["images_materialized"] for line in trainer_lines)
        > 0
    )
    # Every request re-sends all earlier images, and each one is exactly one cache lookup on the engine.
    sent = sum(step["orchestrator"]["images_sent"] for step in summary["per_step"])
    joins = engine.total("rawmm_materialize_cache_inflight_joins_total")
    assert summary["cache_hits"] + summary["cache_misses"] + joins == sent


@pytest.mark.slow
def test_engine_killed_mid_run_stops_the_run_with_a_clear_error(tmp_path, tiny_qwen2_vl):
    plan = plan_local_run(e2e_config(tiny_qwen2_vl), output_dir=tmp_path)
    run = LocalRun(plan)

    def kill_engine_after_the_first_batch() -> None:
        first_batch = plan.config.rollouts_dir / "step_1.msgpack"
        while not first_batch.exists() and run.engines[0].poll() is None and not threading.Event().wait(0.05):
            pass
        os.killpg(run.engines[0].pid, 9)

    killer = threading.Thread(target=kill_engine_after_the_first_batch)
    killer.start()
    started = time.monotonic()
    with pytest.raises(LocalRunFailed, match="engine-0 was killed by signal 9"):
        run.run()
    killer.join()
    assert time.monotonic() - started < 240
    assert_all_stopped(run)
    assert json.loads(plan.summary_path.read_text())["status"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["zero_loss", "error"])
def test_image_deleted_before_training(tmp_path, tiny_qwen2_vl, monkeypatch, policy):
    from rawmm.rl.orchestrator.loop import episode_seed

    # On the path of `rawmm run` (which resolves the factory before starting anything) and of its children.
    monkeypatch.syspath_prepend(str(ENVS_DIR))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS_DIR), os.environ.get("PYTHONPATH", "")]))
    shared = tmp_path / "shared"
    config = e2e_config(
        tiny_qwen2_vl,
        orchestrator={
            "environment": {
                "name": "vanishing:VanishingShapes",
                "args": {"offload_dir": str(shared / "images"), "victim_seed": episode_seed(0, 1, 1)},
            },
            "prompts_per_step": 2,
            "rollouts_per_prompt": 1,
            "max_tokens": 4,
        },
        trainer={"steps": 1, "missing_image_policy": policy},
    )
    plan = plan_local_run(config, output_dir=tmp_path)
    assert plan.config.shared_dir == shared
    run = LocalRun(plan)
    if policy == "zero_loss":
        summary = run.run()
        assert summary["status"] == "completed"
        assert summary["missing_images_trainer"] == 1 and summary["invalid_mm_image_refs"] == 0
        assert summary["images_materialized_trainer"] == 1  # the other group's image trained normally
        assert all(abs(loss) < float("inf") for loss in summary["loss"])
    else:
        with pytest.raises(
            LocalRunFailed, match=r"(?s)trainer exited with code 2.*missing_image_policy=error.*file://"
        ):
            run.run()
    assert_all_stopped(run)
