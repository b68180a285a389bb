"""Child processes of a local run, each in its own process group so stopping it stops its children too.

Output (stdout and stderr) goes to one log file per process. `stop` sends SIGTERM to the group,
waits, then SIGKILLs what is left; it never leaves a process behind. A `Watchdog` does the same for
every group if `rawmm run` itself dies without stopping them (SIGKILL, OOM kill): see `watchdog.py`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def rawmm_argv(*args: str) -> list[str]:
    """The command line of a `rawmm` subcommand run by this interpreter."""
    return [sys.executable, "-m", "rawmm.cli", *args]


@dataclass
class ChildProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log_offset: int = field(default=0, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self, env: Mapping[str, str] | None = None) -> int:
        """Start the process in a new session (its pid is its process group id); returns the pid."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach its children too
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.popen.poll() if self.popen is not None else None

    def new_log_lines(self) -> list[str]:
        """Complete lines appended to the log since the last call."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                data = log.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        return complete.decode(errors="replace").splitlines()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within `grace_s`."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        # Children the process left behind in its group go too, even when it exited by itself.
        _signal_group(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_all(children: Sequence[ChildProcess], grace_s: float = 10.0) -> None:
    """Stop every child: all get SIGTERM first, so they shut down in parallel."""
    for child in children:
        if child.popen is not None and child.popen.poll() is None:
            _signal_group(child.popen.pid, signal.SIGTERM)
    for child in children:
        child.stop(grace_s)


class Watchdog:
    """The watchdog process of a run (`rawmm.run.watchdog`), fed the process groups to stop should we die."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", str(Path(__file__).with_name("watchdog.py"))],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # outside our group: a kill of `rawmm run`'s group spares it
            )
        finally:
            os.close(read_end)
        self._pipe = os.fdopen(write_end, "w", buffering=1)

    def watch(self, pgid: int) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._pipe.write(f"{pgid}\n")

    def release(self) -> None:
        """Everything was stopped by us: the watchdog exits without touching a group."""
        with contextlib.suppress(BrokenPipeError):
            self._pipe.write("done\n")
            self._pipe.close()
        self._process.wait()
