"""`exit_on_sigterm`: a Job's process (PID 1 of its container, where SIGTERM has no default action) ends at
once with 143 when its pod is stopped, unwinding its finally blocks, instead of being SIGKILLed (137: a kill
the Jobs retry)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from rawmm.commands import exit_on_sigterm
    if sys.argv[1] == "handled":
        exit_on_sigterm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    finally:
        print("unwound", flush=True)
    """
)


@pytest.mark.parametrize("mode, code, unwound", [("handled", 143, True), ("default", -15, False)])
def test_sigterm_ends_the_process_with_143_after_unwinding(mode: str, code: int, unwound: bool) -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert ("unwound" in done.stdout) is unwound
