"""A terminated test run still tears its fixtures down (tests/terminate.py), so its servers stop with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SUITE = """
import pathlib, time, pytest

@pytest.fixture(scope="session")
def server():
    pathlib.Path("started").touch()
    yield
    pathlib.Path("torn_down").touch()

def test_runs_until_terminated(server):
    time.sleep(60)
"""


def test_sigterm_runs_the_session_teardown(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "terminate", "-p", "no:cacheprovider", "test_suite.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert run.poll() is None and time.monotonic() < deadline, (
                "the inner run never started its fixture"
            )
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert (tmp_path / "torn_down").exists()
