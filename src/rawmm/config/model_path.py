"""Telling a missing checkpoint from a hub id before anything loads (`rawmm serve --model`, `model.path`).

A hub id is ``name`` or ``owner/name`` and never starts with ``/``, ``.`` or ``~``; anything else names a
local directory, so when that directory is missing the answer is "no such directory", not a hub lookup
that fails minutes later with a message about repository ids.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_path_problem(path: str) -> str | None:
    """Why ``path`` names no model (one phrase), or None for a checkpoint directory or a hub id."""
    try:
        local = Path(path).expanduser()
    except RuntimeError:  # ~user of a user this machine does not have
        return "no such directory"
    if local.is_dir():
        return None
    if local.exists():
        return "is not a checkpoint directory"
    if _HUB_ID.fullmatch(path):
        return None
    return "no such directory"
