"""What the run's pods read at start: the run config (a ConfigMap) and the weights token (a Secret)."""

from __future__ import annotations

from typing import Any

from rawmm.config import RunConfig
from rawmm_operator.names import child_name
from rawmm_operator.objects import Manifest, RunRef, metadata
from rawmm_operator.spec import RUN_CONFIG_FILE

# The engines' and orchestrator's shared secret for `POST /v1/rawmm/weights` (issue #13): a Secret per run.
WEIGHTS_TOKEN_ENV = "RAWMM_WEIGHTS_TOKEN"
WEIGHTS_TOKEN_KEY = "token"


def build_config_map(run: RunRef, config: RunConfig) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(run, child_name(run.name, "config"), "config"),
        "data": {RUN_CONFIG_FILE: config.to_yaml()},
    }


def build_weights_secret(run: RunRef, token: str) -> Manifest:
    """The run's weights-endpoint token: created once with a random `token`, never rewritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(run, child_name(run.name, "weights"), "weights"),
        "type": "Opaque",
        "stringData": {WEIGHTS_TOKEN_KEY: token},
    }


def weights_token_env(run: RunRef) -> dict[str, Any]:
    """The variable that hands a container the run's weights token from its Secret."""
    ref = {"name": child_name(run.name, "weights"), "key": WEIGHTS_TOKEN_KEY}
    return {"name": WEIGHTS_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}
