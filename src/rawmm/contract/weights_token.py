"""The shared secret that lets a run's orchestrator (and nobody else) swap its engines' weights.

Engines read it from ``$RAWMM_WEIGHTS_TOKEN`` and refuse weight updates without it; the orchestrator reads
the same variable and sends it as ``Authorization: Bearer <token>``. ``rawmm run`` generates one per run; in
Kubernetes the operator puts one per run in a Secret and injects it into the engine and orchestrator pods.
"""

from __future__ import annotations

import os
import secrets

WEIGHTS_TOKEN_ENV = "RAWMM_WEIGHTS_TOKEN"


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def auth_headers() -> dict[str, str]:
    """The ``Authorization`` header for this process's token; empty when none is set."""
    token = os.environ.get(WEIGHTS_TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}
