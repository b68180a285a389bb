"""The watchdog of a local run (`rawmm.run.watchdog`): stops the run's process groups when `rawmm run` dies.

Every group here is a stand-in started by the test: a leader (reaped by a thread, as `rawmm run` or init
would reap it) and a grandchild that the leader leaves behind. Each of them holds the write end of a pipe
the test reads: end of file on it means every holder is gone, so death is awaited, never slept for.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rawmm.run import watchdog
from rawmm.run.processes import Watchdog

WAIT_S = 30.0
WATCHDOG_SCRIPT = Path(watchdog.__file__)

# A group leader that leaves a grandchild in its group; both hold fd `alive` (inherited), and the leader
# says `ready` on stdout once both have set their SIGTERM disposition: "exit" (the default action) or
# "ignore" (only SIGKILL ends it), the leader's and the grandchild's.
GROUP = textwrap.dedent(
    """
    import signal, subprocess, sys
    alive, leader_term, grandchild_term = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    grandchild = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; "
         + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if grandchild_term == "ignore" else "")
         + "print('ready', flush=True); signal.pause()"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, pass_fds=[alive],
    )
    grandchild.stdout.readline()
    if leader_term == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:  # answers pings while it lives
        print("pong", flush=True)
    """
)


@dataclass
class Group:
    popen: subprocess.Popen[str]
    alive_read: int

    @property
    def pgid(self) -> int:
        return self.popen.pid

    def gone(self, timeout: float = WAIT_S) -> bool:
        """Whether the leader and its grandchild have both exited (waits up to ``timeout`` for it)."""
        ready, _, _ = select.select([self.alive_read], [], [], timeout)
        return bool(ready) and os.read(self.alive_read, 1) == b""

    def answers(self) -> bool:
        """A ping answered: the leader is alive and was not signalled to death (a pending signal would end
        it before it read the ping)."""
        try:
            assert self.popen.stdin is not None and self.popen.stdout is not None
            self.popen.stdin.write("ping\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            return False
        return self.popen.stdout.readline() == "pong\n"


@pytest.fixture
def start_group(tmp_path: Path) -> Iterator[object]:
    groups: list[Group] = []

    def start(leader_term: str = "exit", grandchild_term: str = "exit") -> Group:
        alive_read, alive_write = os.pipe()
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", GROUP, str(alive_write), leader_term, grandchild_term],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
                pass_fds=[alive_write],
            )
        finally:
            os.close(alive_write)
        group = Group(popen, alive_read)
        groups.append(group)
        assert popen.stdout is not None and popen.stdout.readline() == "ready\n"
        # Reaped as soon as it exits, as `rawmm run` (or init, once it died) reaps it: a zombie leader
        # would keep its group alive in the watchdog's eyes.
        threading.Thread(target=popen.wait, daemon=True).start()
        return group

    yield start
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pgid, signal.SIGKILL)
        group.gone()
        os.close(group.alive_read)
        for stream in (group.popen.stdin, group.popen.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()


def start_watchdog() -> subprocess.Popen[bytes]:
    """The watchdog as `Watchdog` starts it: the script, isolated, in its own session, fed on stdin."""
    return subprocess.Popen(
        [sys.executable, "-I", str(WATCHDOG_SCRIPT)], stdin=subprocess.PIPE, start_new_session=True
    )


def test_stop_groups_terminates_each_group_and_kills_what_it_left_behind(start_group) -> None:
    first, second = start_group(), start_group()
    started = time.monotonic()
    watchdog.stop_groups([first.pgid, second.pgid], grace_s=WAIT_S)
    assert time.monotonic() - started < WAIT_S / 2, "waited out the grace period for groups already gone"
    assert first.gone() and second.gone(), "a leader or its grandchild survived"
    assert first.popen.wait(WAIT_S) == second.popen.wait(WAIT_S) == -signal.SIGTERM


@pytest.mark.parametrize(
    ("leader_term", "leader_end"), [("exit", -signal.SIGTERM), ("ignore", -signal.SIGKILL)]
)
def test_stop_groups_kills_what_ignores_sigterm_once_the_grace_period_is_over(
    start_group, leader_term: str, leader_end: int
) -> None:
    stubborn = start_group(leader_term=leader_term, grandchild_term="ignore")
    started = time.monotonic()
    watchdog.stop_groups([stubborn.pgid], grace_s=0.5)
    assert time.monotonic() - started >= 0.5, "SIGKILL came before the grace period was over"
    assert stubborn.gone(), "a process of the group survived"
    assert stubborn.popen.wait(WAIT_S) == leader_end


def test_stop_groups_passes_over_groups_that_are_already_gone(start_group) -> None:
    finished = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    finished.wait()
    live = start_group()
    watchdog.stop_groups([finished.pid, live.pgid], grace_s=WAIT_S)
    assert live.gone()


def test_end_of_input_without_done_stops_every_group(start_group) -> None:
    groups = [start_group(), start_group()]
    process = start_watchdog()
    assert process.stdin is not None
    process.stdin.write(b"".join(f"{group.pgid}\n".encode() for group in groups))
    process.stdin.close()  # what the kernel does when `rawmm run` dies, however it dies
    assert process.wait(WAIT_S) == 0
    assert all(group.gone() for group in groups)


def test_done_leaves_every_group_running(start_group) -> None:
    group = start_group()
    process = start_watchdog()
    assert process.stdin is not None
    process.stdin.write(f"{group.pgid}\ndone\n".encode())
    process.stdin.close()
    assert process.wait(WAIT_S) == 0
    assert group.answers(), "the watchdog signalled a group after `done`"


def test_ctrl_c_does_not_stop_the_watchdog(start_group) -> None:
    """Ctrl-C reaches `rawmm run`, which stops its children itself; the watchdog waits for its word."""
    group = start_group()
    process = start_watchdog()
    assert process.stdin is not None
    process.stdin.write(f"{group.pgid}\n".encode())
    process.stdin.flush()
    wait_until_ignoring_sigint(process.pid)
    process.send_signal(signal.SIGINT)
    process.stdin.close()
    assert process.wait(WAIT_S) == 0
    assert group.gone()


def wait_until_ignoring_sigint(pid: int) -> None:
    """Until the process's ignored-signal mask (in /proc) has SIGINT: it has set its disposition."""
    deadline = time.monotonic() + WAIT_S
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        if ignored & (1 << (signal.SIGINT - 1)):
            return
        assert time.monotonic() < deadline, "the watchdog never set SIGINT aside"
        select.select([], [], [], 0.01)


# --- the `Watchdog` handle `rawmm run` holds ----------------------------------------------------------

OWNER = textwrap.dedent(
    """
    import sys
    from rawmm.run.processes import Watchdog
    watchdog = Watchdog()
    watchdog.watch(int(sys.argv[1]))
    print("watching", flush=True)
    sys.stdin.read()  # until the test kills us
    """
)


def test_the_groups_of_an_owner_killed_with_sigkill_are_stopped(start_group) -> None:
    group = start_group()
    # The watchdog inherits the owner's stderr: its end of file says the watchdog has exited too.
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(group.pgid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"watching\n"
        owner.kill()  # no handler, no finally: only the pipe's end tells the watchdog
        owner.wait()
        assert group.gone(), "the group outlived its owner"
        assert owner.stderr is not None
        ready, _, _ = select.select([owner.stderr], [], [], WAIT_S)
        assert ready and owner.stderr.read() == b"", "the watchdog did not exit after stopping the groups"
    finally:
        owner.kill()
        owner.wait()
        for stream in (owner.stdin, owner.stdout, owner.stderr):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()


def test_release_ends_the_watchdog_and_leaves_the_groups_alone(start_group) -> None:
    group = start_group()
    handle = Watchdog()
    handle.watch(group.pgid)
    handle.release()  # returns once the watchdog process has exited
    assert group.answers()
