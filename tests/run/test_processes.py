"""A local run's child processes (`rawmm.run.processes`): their logs, their process groups and how they stop.

Death is awaited, never slept for: a pidfd of each stand-in and of the grandchild it leaves in its group
turns readable when that process exits, and a stand-in says `ready` in its log once its signal dispositions
are set.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rawmm.run.processes import ChildProcess, rawmm_argv, stop_all

WAIT_S = 30.0

# argv: what the stand-in does on SIGTERM ("exit"; "ignore"; "wait:<fifo>": read the fifo, then exit 3;
# "tell:<fifo>": write to the fifo, then exit 4), whether it leaves a grandchild (which ignores SIGTERM) in
# its group ("grandchild" or "alone"), and what it does once ready ("serve": wait forever, "exit": end).
STAND_IN = textwrap.dedent(
    """
    import signal, subprocess, sys
    term, family, then = sys.argv[1:]
    grandchild = None
    if family == "grandchild":
        grandchild = subprocess.Popen(
            [sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print('ready', flush=True); signal.pause()"],
            stdout=subprocess.PIPE,
        )
        grandchild.stdout.readline()
    if term == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif term.startswith("wait:"):
        def on_term(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop() may repeat it: once is enough
            with open(term[5:]) as fifo:  # blocks until another process opens it to write
                fifo.read()
            sys.exit(3)
        signal.signal(signal.SIGTERM, on_term)
    elif term.startswith("tell:"):
        def on_term(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(term[5:], "w") as fifo:
                fifo.write("terminated")
            sys.exit(4)
        signal.signal(signal.SIGTERM, on_term)
    print("ready", grandchild.pid if grandchild else "", flush=True)
    if then == "serve":
        while True:
            signal.pause()
    """
)


class StandIn:
    def __init__(self, tmp_path: Path, name: str) -> None:
        self.tmp_path, self.name = tmp_path, name
        self.child: ChildProcess | None = None
        self.pidfds: list[int] = []

    def start(self, term: str = "exit", family: str = "alone", then: str = "serve") -> ChildProcess:
        argv = [sys.executable, "-c", STAND_IN, term, family, then]
        self.child = ChildProcess(self.name, argv, self.tmp_path / "logs" / f"{self.name}.log")
        self.pidfds.append(os.pidfd_open(self.child.start()))
        ready = self.wait_ready().split()
        if len(ready) > 1:
            self.pidfds.append(os.pidfd_open(int(ready[1])))
        return self.child

    def wait_ready(self) -> str:
        """The stand-in's `ready` line, once it is written (each wait ends early should the stand-in die)."""
        assert self.child is not None
        for _ in range(int(WAIT_S / 0.02)):
            exited, _, _ = select.select(self.pidfds[:1], [], [], 0.02)
            if (line := self.child.log_tail(1)).startswith("ready"):
                return line
            assert not exited, f"{self.name} ended before it was ready:\n{self.child.log_tail()}"
        raise AssertionError(f"{self.name} was not ready within {WAIT_S} s")

    def gone(self, timeout: float = WAIT_S) -> bool:
        """Whether the stand-in and the grandchild it left have exited (waits up to ``timeout``)."""
        exited, _, _ = select.select(self.pidfds, [], [], 0)
        waiting = [fd for fd in self.pidfds if fd not in exited]
        return all(select.select([fd], [], [], timeout)[0] for fd in waiting)


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[object]:
    made: list[StandIn] = []

    def make(name: str = "engine") -> StandIn:
        made.append(StandIn(tmp_path, name))
        return made[-1]

    yield make
    for one in made:
        if one.child is not None and one.child.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(one.child.popen.pid, signal.SIGKILL)
            one.child.popen.wait()
            one.gone()
        for fd in one.pidfds:
            os.close(fd)


def test_rawmm_argv_runs_a_subcommand_with_this_interpreter() -> None:
    done = subprocess.run(rawmm_argv("--help"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rawmm") and "orchestrate" in done.stdout


def test_rawmm_argv_reports_a_user_error_in_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The one-line error holds when the CLI runs as `-m rawmm.cli`: CliError lives in rawmm.commands."""
    done = subprocess.run(
        rawmm_argv("orchestrate", str(tmp_path / "absent.yaml")), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_start_runs_the_process_in_its_own_group_with_output_in_its_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "deep" / "trainer.log"
    log.parent.mkdir(parents=True)
    log.write_text("from an earlier run\n")
    script = (
        "import os, sys; print('out', os.getpgid(0) == os.getpid(), os.environ['PYTHONUNBUFFERED'], "
        "os.environ['RAWMM_TEST_VALUE']); print('err', file=sys.stderr); print('stdin', repr(sys.stdin.read()))"
    )
    child = ChildProcess("trainer", [sys.executable, "-c", script], log)
    assert (child.pid, child.poll()) == (None, None)
    # Whatever our own stdin holds (a terminal in real use: here a pipe with a line in it), the child reads none.
    typed_read, typed_write = os.pipe()
    os.write(typed_write, b"typed\n")
    os.close(typed_write)
    saved_stdin = os.dup(0)
    os.dup2(typed_read, 0)
    try:
        pid = child.start(env={"RAWMM_TEST_VALUE": "given"})
    finally:
        os.dup2(saved_stdin, 0)
        os.close(saved_stdin)
        os.close(typed_read)
    assert pid == child.pid
    assert child.popen is not None and child.popen.wait(WAIT_S) == 0
    assert child.poll() == 0
    assert log.read_text().splitlines() == [
        "from an earlier run",  # appended to, never truncated
        "out True 1 given",
        "err",
        "stdin ''",
    ]


def test_the_environment_passed_to_start_wins_over_the_inherited_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAWMM_TEST_VALUE", "inherited")
    monkeypatch.setenv("RAWMM_TEST_OTHER", "kept")
    script = "import os; print(os.environ['RAWMM_TEST_VALUE'], os.environ['RAWMM_TEST_OTHER'])"
    child = ChildProcess("x", [sys.executable, "-c", script], tmp_path / "x.log")
    child.start(env={"RAWMM_TEST_VALUE": "given"})
    assert child.popen is not None and child.popen.wait(WAIT_S) == 0
    assert child.log_tail() == "given kept"


def test_new_log_lines_hands_out_complete_lines_once(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    child = ChildProcess("x", [], log)
    assert child.new_log_lines() == []  # no log yet
    with log.open("ab") as out:
        out.write(b"one\ntwo\npart")
        out.flush()
        assert child.new_log_lines() == ["one", "two"]
        assert child.new_log_lines() == []  # the partial line waits for its end
        out.write(b"ial\n\xff bytes\n")
        out.flush()
        assert child.new_log_lines() == ["partial", "\ufffd bytes"]
        assert child.new_log_lines() == []


def test_log_tail_is_the_last_lines_or_nothing(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    child = ChildProcess("x", [], log)
    assert child.log_tail() == ""
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    assert child.log_tail(3) == "line 17\nline 18\nline 19"
    assert child.log_tail().splitlines() == [f"line {i}" for i in range(5, 20)]


def test_stopping_a_process_never_started_does_nothing(tmp_path: Path) -> None:
    child = ChildProcess("x", [sys.executable, "-c", "pass"], tmp_path / "x.log")
    child.stop(grace_s=0)
    stop_all([child], grace_s=0)
    assert child.popen is None and not (tmp_path / "x.log").exists()


def test_stop_terminates_the_group_and_kills_what_the_process_left_in_it(stand_in) -> None:
    engine = stand_in()
    child = engine.start(term="exit", family="grandchild")
    child.stop(grace_s=WAIT_S)
    assert child.poll() == -signal.SIGTERM
    assert engine.gone(), "the grandchild, which ignores SIGTERM, outlived the stop"


def test_stop_kills_a_process_that_ignores_sigterm_once_the_grace_period_is_over(stand_in) -> None:
    engine = stand_in()
    child = engine.start(term="ignore")
    child.stop(grace_s=0.5)
    assert child.poll() == -signal.SIGKILL
    assert engine.gone()


def test_stop_after_the_process_exited_still_kills_what_it_left_behind(stand_in) -> None:
    trainer = stand_in("trainer")
    child = trainer.start(family="grandchild", then="exit")
    assert child.popen is not None and child.popen.wait(WAIT_S) == 0
    assert not trainer.gone(timeout=0), "the grandchild should still be running"
    child.stop(grace_s=WAIT_S)
    assert child.poll() == 0
    assert trainer.gone()


def test_stop_all_signals_every_child_before_waiting_for_any(stand_in, tmp_path: Path) -> None:
    """The first child's SIGTERM handler waits for the second child's word that it got SIGTERM as well:
    stopping one child at a time would leave the first one waiting until it is killed."""
    fifo = tmp_path / "terminated"
    os.mkfifo(fifo)
    first = stand_in("orchestrator").start(term=f"wait:{fifo}")
    second = stand_in("trainer").start(term=f"tell:{fifo}")
    stop_all([first, second], grace_s=WAIT_S)
    assert (first.poll(), second.poll()) == (3, 4)


def test_stop_all_stops_children_that_already_exited_or_never_started(stand_in, tmp_path: Path) -> None:
    engine = stand_in()
    running = engine.start(term="exit", family="grandchild")
    never = ChildProcess("never", [], tmp_path / "never.log")
    exited = ChildProcess("exited", [sys.executable, "-c", "raise SystemExit(5)"], tmp_path / "exited.log")
    exited.start()
    assert exited.popen is not None and exited.popen.wait(WAIT_S) == 5
    stop_all([never, exited, running], grace_s=WAIT_S)
    assert (never.poll(), exited.poll(), running.poll()) == (None, 5, -signal.SIGTERM)
    assert engine.gone()
