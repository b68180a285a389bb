"""Who may swap an engine's weights, and from where: a shared token and one checkpoint directory.

Any pod that reaches an engine's Service could otherwise load weights from any path it names. A weights
request must carry ``Authorization: Bearer <token>`` equal to ``$RAWMM_WEIGHTS_TOKEN`` (the operator's
per-run Secret; a token ``rawmm run`` generates), and its path must resolve, symlinks followed, inside
``--weights-root`` (the run's checkpoint directory). An engine missing either refuses every weights
request: closed by default, so a forgotten setting never leaves the door open.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from rawmm.contract.store import path_problem
from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV

_BEARER = "bearer "


class WeightsRefused(Exception):
    """A weights request the guard turns away: ``status`` 403 (not allowed) or 400 (not a path)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class WeightsGuard:
    token: str | None  # None: no token configured, every request refused
    root: Path | None  # resolved; None: no weights root configured, every request refused

    @classmethod
    def from_env(cls, root: Path | None) -> WeightsGuard:
        return cls(token=os.environ.get(WEIGHTS_TOKEN_ENV) or None, root=root.resolve() if root else None)

    def authorize(self, header: str | None) -> None:
        """Check the ``Authorization`` header (constant-time); raises ``WeightsRefused`` (403)."""
        if self.token is None or self.root is None:
            missing = f"${WEIGHTS_TOKEN_ENV}" if self.token is None else "--weights-root"
            raise WeightsRefused(
                403, "weights_disabled", f"weight updates are disabled on this engine: no {missing}"
            )
        if header is None or not header.lower().startswith(_BEARER):
            raise WeightsRefused(403, "missing_token", "weight updates need 'Authorization: Bearer <token>'")
        given = header[len(_BEARER) :].strip().encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self.token.encode()):
            raise WeightsRefused(403, "invalid_token", "the weights token is wrong")

    def confine(self, path: str) -> Path:
        """The real path of ``path`` if it lies inside the weights root; raises ``WeightsRefused``."""
        assert self.root is not None, "authorize() first"
        if (problem := path_problem(path)) is not None:
            raise WeightsRefused(400, "malformed_path", f"weights path: {problem}")
        candidate = Path(path)
        if not candidate.is_absolute():
            raise WeightsRefused(400, "malformed_path", f"the weights path {path[:200]!r} is not absolute")
        try:
            real = candidate.resolve()
        except (OSError, RuntimeError) as exc:
            raise WeightsRefused(400, "malformed_path", f"cannot resolve {path[:200]!r}: {exc}") from None
        if not real.is_relative_to(self.root):
            raise WeightsRefused(
                403, "outside_weights_root", f"{path[:200]!r} is outside the weights root {self.root}"
            )
        return real


# What an engine without a guard configured gets: every weights request refused.
WEIGHTS_DISABLED = WeightsGuard(token=None, root=None)
