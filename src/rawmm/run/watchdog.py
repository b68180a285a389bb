"""Stops a local run's process groups when `rawmm run` dies without stopping them itself (SIGKILL, OOM).

Run as a script (stdlib only, so it starts in milliseconds) in its own session, with the read end of a
pipe as stdin. `rawmm run` writes one line per process group it starts (the group id) and `done` once it
has stopped them all itself. End of input without `done` means `rawmm run` is gone: every group gets
SIGTERM, then SIGKILL after the grace period, so engines, trainer and orchestrator (and their own
children) never outlive the run. A pipe rather than a parent-death signal: the kernel closes it however
the parent dies, and the group kill reaches grandchildren that a per-process signal would miss.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

GRACE_S = 10.0


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(pgids: list[int], grace_s: float) -> None:
    """SIGTERM every group, wait up to ``grace_s`` for all to go, SIGKILL what is left."""
    for pgid in pgids:
        _signal(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(pgid) for pgid in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in pgids:
        _signal(pgid, signal.SIGKILL)


def main() -> None:
    # Ctrl-C in the terminal reaches `rawmm run`, which stops its children itself; the watchdog waits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgids: list[int] = []
    for line in sys.stdin:
        if line.strip() == "done":
            return
        pgids.append(int(line))
    stop_groups(pgids, GRACE_S)


if __name__ == "__main__":
    main()
