"""Byte sizes written as plain integers or Kubernetes quantities (``2Gi``, ``500M``, ``1.5Ki``).

One parser for every place a size is configured (CLI flag, environment variable, run config, RLRun),
so a value accepted in one place is accepted everywhere. Dependency-free on purpose: both the
operator (via ``rawmm.config``) and the serving side import it.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_SUFFIX_FACTORS: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
# The accepted text, also published as the `pattern` of every byte-size field in the RLRun CRD schema.
BYTE_SIZE_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(" + "|".join(s for s in _SUFFIX_FACTORS if s) + ")?$"
_QUANTITY = re.compile(BYTE_SIZE_PATTERN)


def parse_byte_size(value: str | int) -> int:
    """Return the number of bytes in ``value``; fractional results round up (as Kubernetes does for memory).

    Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid byte size {value!r}: expected an integer or a quantity such as 2Gi")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid byte size {value}: must not be negative")
        return value
    # The whole text, as the API server matches the schema's pattern: no stripping, and no `$` before a
    # trailing newline (Python's `match` would let "2Gi\n" through where RE2 refuses it).
    match = _QUANTITY.fullmatch(str(value))
    if match is None:
        raise ValueError(
            f"invalid byte size {value!r}: expected bytes or a Kubernetes quantity "
            "(suffix Ki, Mi, Gi, Ti, Pi, Ei or k, M, G, T, P, E), e.g. 2Gi or 0 to disable"
        )
    number, suffix = match[1], match[3] or ""
    return math.ceil(Decimal(number) * _SUFFIX_FACTORS[suffix])
