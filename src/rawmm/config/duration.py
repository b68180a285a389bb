"""Durations written as ``90s``, ``10m``, ``1h30m`` or ``7d``: one parser for the CLI, the run config and the RLRun.

Dependency-free, like ``rawmm.config.quantity``: the operator imports it through ``rawmm.config``.
"""

from __future__ import annotations

import re

_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# Units largest first, each at most once, at least one; also the `pattern` of every duration field in the
# RLRun schema, so RE2 syntax only (kube-apiserver refuses a CRD with a lookahead): one alternative per
# leading unit.
DURATION_PATTERN = (
    r"^(([0-9]+d)([0-9]+h)?([0-9]+m)?([0-9]+s)?|([0-9]+h)([0-9]+m)?([0-9]+s)?|([0-9]+m)([0-9]+s)?|([0-9]+s))$"
)
_DURATION = re.compile(DURATION_PATTERN)


def parse_duration(text: str) -> int:
    """Seconds in ``text``; raises ``ValueError`` naming the bad value and the accepted form."""
    # The whole text, as the API server matches the schema's pattern (no stripping, no newline before `$`).
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"invalid duration {text!r}: expected e.g. 90s, 10m, 1h30m or 7d (units d, h, m, s)")
    units = match.groups()[1:]  # group 1 is the whole alternative
    return sum(int(part[:-1]) * _UNIT_SECONDS[part[-1]] for part in units if part)
