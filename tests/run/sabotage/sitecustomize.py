"""Breaks learning on purpose in every process of a run that has this directory on its PYTHONPATH, to show
that tests/run/test_learning.py fails when learning breaks: RAWMM_SABOTAGE=negate-advantages (the
orchestrator trains away from what scored well) or no-weight-reload (the engines keep serving the weights
they started with, so the rollouts never improve)."""

from __future__ import annotations

import os

_MODE = os.environ.get("RAWMM_SABOTAGE", "")

if _MODE == "negate-advantages":
    from rawmm.rl.orchestrator import advantages

    _honest = advantages.group_advantages

    def _negated(rewards, eps=1e-6):  # type: ignore[no-untyped-def]
        return [-a for a in _honest(rewards, eps)]

    advantages.group_advantages = _negated
elif _MODE == "no-weight-reload":
    from rawmm.rl.orchestrator import replicas

    async def _ignore(self, path):  # type: ignore[no-untyped-def]
        self._weights_path = path  # remembered, never sent: the engines keep their first weights

    replicas.ReplicaPool.load_weights = _ignore
elif _MODE:
    raise SystemExit(f"unknown RAWMM_SABOTAGE {_MODE!r}")
