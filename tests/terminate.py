"""A pytest plugin (loaded by tests/conftest.py): a terminated run ends like an interrupted one.

pytest tears down on Ctrl-C (KeyboardInterrupt) but not on SIGTERM, which is how CI timeouts and a killed
`make` end a run; the servers the session fixtures started (the control plane, vLLM, Prometheus) then
outlived it. Raising KeyboardInterrupt on SIGTERM runs every fixture's teardown, so they stop with it.
"""

from __future__ import annotations

import signal
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)
