"""`rawmm run` with two real engine replicas: losing one mid-run is reported, and the run goes on on the other."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest
from test_local import assert_all_stopped, e2e_config

from rawmm.run import LocalRun, plan_local_run
from rawmm.run.scrape import scrape


def ok_requests(http: httpx.Client, url: str) -> float | None:
    found = scrape(http, f"{url}/metrics")
    return None if found is None else found.value("rawmm_engine_requests_total", status="ok") or 0.0


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_reported_and_the_other_serves_the_rest(tmp_path, tiny_qwen2_vl):
    plan = plan_local_run(
        e2e_config(tiny_qwen2_vl, inference={"replicas": 2}, trainer={"steps": 2}), output_dir=tmp_path
    )
    run = LocalRun(plan)
    urls = list(plan.config.inference.urls)
    killed: dict = {}
    run_over = threading.Event()

    def kill_a_replica_after_the_first_batch() -> None:
        # Step 2's rollouts wait for the trainer's step 1 (max_async_level 1), so every one of them comes after
        # the kill. The replica that served more of step 1 goes: its rollouts must move to the other.
        first_batch = plan.config.rollouts_dir / "step_1.msgpack"
        deadline = time.monotonic() + 120
        while not first_batch.exists():
            if run_over.wait(0.05) or time.monotonic() > deadline:
                return
        with httpx.Client(timeout=5) as http:
            served = [ok_requests(http, url) for url in urls]
        if None in served:
            return
        victim = max(range(len(urls)), key=lambda i: served[i])
        killed.update(victim=victim, survivor=1 - victim, survivor_ok=served[1 - victim], served=served)
        os.killpg(run.engines[victim].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_a_replica_after_the_first_batch)
    killer.start()
    try:
        summary = run.run()
    finally:
        run_over.set()
        killer.join()
    assert "victim" in killed, (
        "no replica was killed: the first batch never came, or an engine did not answer"
    )
    victim = run.engines[killed["victim"]]
    victim_url, survivor_url = urls[killed["victim"]], urls[killed["survivor"]]

    assert summary["status"] == "completed" and summary["error"] is None
    assert summary["steps_completed"] == summary["steps"] == 2
    assert [step["trainer"] is not None for step in summary["per_step"]] == [True, True]
    assert victim.poll() == -signal.SIGKILL
    (warning,) = summary["warnings"]
    assert warning.startswith(f"{victim.name} was killed by signal 9")
    assert f"engine replica {victim_url} marked down" in run.orchestrator.log_path.read_text()
    # The survivor served step 2 and loaded both new checkpoints; the dead replica answers nothing.
    assert summary["engine_weights_version"] == {victim_url: None, survivor_url: 2}
    final_ok = run.state.engines[survivor_url].value("rawmm_engine_requests_total", status="ok")
    assert final_ok is not None and final_ok > killed["survivor_ok"], (killed, final_ok)

    assert_all_stopped(run)
    for child in run.children:  # no process of any group is left, grandchildren included
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)
    monitoring = plan.config.monitoring
    ports = [*plan.engine_ports, monitoring.orchestrator_metrics_port, monitoring.trainer_metrics_port]
    assert [port for port in ports if not port_free(port)] == []
