"""The `rawmm serve` command line of an engine replica, built from the run config in one place: `rawmm run`
starts its local replicas with it and the operator's engine StatefulSet runs it (docs/architecture.md §6).

Every setting travels as a flag, the cache budget included, so a replica's command line says all it runs
with; only the weights token travels in the environment (`$RAWMM_WEIGHTS_TOKEN`: a secret has no place
on a command line). What differs between the two callers is where the replica listens. Light, like
`rawmm.config`: the operator imports it.
"""

from __future__ import annotations

from rawmm.config import RunConfig


def serve_argv(config: RunConfig, *, host: str, port: int) -> list[str]:
    """`serve` and its arguments for one replica of `config`'s engines, listening on `host:port`: the
    offload store and the checkpoints (the only place weight updates load from) are the run's shared
    directory's, vLLM's own arguments (`inference.vllm_args`) follow `--`."""
    model, inference = config.model, config.inference
    argv = [
        "serve",
        "--model", model.path,
        "--engine", inference.engine,
        "--host", host,
        "--port", str(port),
        "--offload-root", str(config.offload_dir),
        "--materialize-cache-size", inference.materialize_cache_size,
        "--processor-backend", model.backend,
        "--weights-root", str(config.checkpoints_dir),
    ]  # fmt: skip
    if model.trust_remote_code:
        argv.append("--trust-remote-code")
    if inference.vllm_args:
        argv += ["--", *inference.vllm_args]
    return argv
