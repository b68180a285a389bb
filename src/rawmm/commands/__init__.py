"""The `rawmm` subcommands, one module each (dispatched by `rawmm.cli`), and the error they report."""

import signal
from types import FrameType


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""


def exit_on_sigterm() -> None:
    """Exit with 143 on SIGTERM, unwinding (finally blocks run). A container's PID 1 has no default action
    for SIGTERM (the kernel drops it), so a stopped pod would wait out its grace period and end by SIGKILL
    (137), which the run's Jobs take for a kill and retry."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
