"""`rawmm serve`: an engine replica that takes raw image refs (transformers on CPU, or vLLM)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from rawmm.commands import CliError
from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV

if TYPE_CHECKING:
    from rawmm.materialize import LoadedProcessor
    from rawmm.serving.images import RequestImages

CACHE_SIZE_ENV = "RAWMM_MATERIALIZE_CACHE_SIZE"


def port_number(text: str) -> int:
    """An argparse type: a TCP port a server can listen on (0 would pick a random one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1-65535")
    return port


def claim_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, before anything slow runs: a busy port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rawmm.config import EngineKind
    from rawmm.contract.families import BACKENDS

    parser.add_argument("--model", required=True, help="checkpoint directory (or hub id) to serve")
    parser.add_argument("--engine", choices=get_args(EngineKind), default="transformers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8100, help="TCP port, 1-65535 (default 8100)")
    parser.add_argument(
        "--offload-root",
        action="append",
        required=True,
        type=Path,
        help="offload store directory refs may point into (repeatable)",
    )
    parser.add_argument(
        "--materialize-cache-size",
        default=os.environ.get(CACHE_SIZE_ENV, "2Gi"),
        help=f"byte budget of the materialize cache: bytes or a quantity like 2Gi; 0 turns it off "
        f"(default: ${CACHE_SIZE_ENV} or 2Gi)",
    )
    parser.add_argument(
        "--processor-backend",
        choices=BACKENDS,
        default=None,
        help="image-processor backend (part of every ref's fingerprint); default: the one vLLM's own image "
        "path runs for the model's family (torchvision for Qwen-VL, pil for Kimi K2.5), on either engine",
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the dtype the transformers engine serves in (default float32; with --engine vllm give vLLM's "
        "own --dtype after `--`)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="refuse images larger than this (decompression bombs); default 64Mi pixels",
    )
    parser.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=None,
        help="decoded pixels all requests may materialize at once (about 20 bytes each at the peak); "
        "default: the image pixel limit, so at most one image that large at a time",
    )
    parser.add_argument(
        "--weights-root",
        type=Path,
        metavar="DIR",
        help="the only directory weight updates may load from (symlinks resolved); with "
        f"${WEIGHTS_TOKEN_ENV} set, POST /v1/rawmm/weights is open to holders of that token. "
        "Without both, every weights request is refused (403)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "vllm_args", nargs="*", help="after `--`: extra arguments for vLLM's server (--engine vllm only)"
    )


def run(args: argparse.Namespace) -> int:
    from rawmm.config.quantity import parse_byte_size

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    try:
        cache_bytes = parse_byte_size(args.materialize_cache_size)
    except ValueError as exc:
        raise CliError(f"--materialize-cache-size: {exc}") from None
    for root in args.offload_root:
        if not root.is_dir():
            raise CliError(f"--offload-root {root} is not a directory")
    if args.weights_root is not None and not args.weights_root.is_dir():
        raise CliError(f"--weights-root {args.weights_root} is not a directory")
    for option in ("max_image_pixels", "max_pixels_in_flight"):
        if (value := getattr(args, option)) is not None and value < 1:
            raise CliError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    if args.vllm_args and args.engine != "vllm":
        raise CliError(f"extra arguments {args.vllm_args} are for --engine vllm only")
    if args.dtype is not None and args.engine == "vllm":
        raise CliError("--dtype is the transformers engine's: give vLLM its own after `--` (-- --dtype ...)")
    _check_model(args.model)
    # vLLM binds its own socket later; the probe still makes a busy port a one-line error within a second.
    sock = claim_port(args.host, args.port)
    if args.engine == "vllm":
        sock.close()

    from rawmm.materialize import DEFAULT_MAX_IMAGE_PIXELS, MaterializeCache, load_processor
    from rawmm.materialize.cache import share_one_allocator_arena
    from rawmm.serving.images import PixelBudget, RequestImages

    share_one_allocator_arena()  # before torch, vLLM or the materialize workers start threads

    try:
        # uint8 items: the transformers engine normalizes on use (vLLM picks its own representation below).
        processor = load_processor(args.model, args.processor_backend, args.trust_remote_code, pixels="uint8")
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load the image processor of {args.model}: {exc}") from None
    max_pixels = DEFAULT_MAX_IMAGE_PIXELS if args.max_image_pixels is None else args.max_image_pixels
    images = RequestImages(
        processor,
        roots=args.offload_root,
        cache=MaterializeCache(cache_bytes),
        max_pixels=max_pixels,
        budget=PixelBudget(args.max_pixels_in_flight or max_pixels),
    )
    log = logging.getLogger("rawmm.serve")
    log.info(
        "serving %s (%s engine, %s, processor %s/%s, fingerprint %s, materialize cache %d bytes)",
        args.model,
        args.engine,
        processor.family.name,
        type(processor.processor).__name__,
        processor.backend,
        processor.fingerprint,
        cache_bytes,
    )
    if args.engine == "vllm":
        return _serve_vllm(args, images)
    return _serve_transformers(args, processor, images, sock)


def _check_model(model: str) -> None:
    from rawmm.config.model_path import model_path_problem

    if (problem := model_path_problem(model)) is not None:
        raise CliError(f"--model {model}: {problem}")


def _serve_transformers(
    args: argparse.Namespace, processor: LoadedProcessor, images: RequestImages, sock: socket.socket
) -> int:
    import asyncio

    import torch
    import uvicorn

    from rawmm.serving.guard import WeightsGuard
    from rawmm.serving.routes import create_app
    from rawmm.serving.transformers_engine import TransformersEngine

    try:
        engine = TransformersEngine(args.model, processor, dtype=getattr(torch, args.dtype or "float32"))
    except Exception as exc:  # noqa: BLE001 - a checkpoint that does not load (a bad safetensors header, a
        # config.json that is no model's) is a bad --model: one line, not a traceback
        raise CliError(f"cannot load {args.model}: {exc}") from None
    app = create_app(engine, images, WeightsGuard.from_env(args.weights_root))
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        asyncio.run(engine.close())
    return 0


def _serve_vllm(args: argparse.Namespace, images: RequestImages) -> int:
    import asyncio

    from rawmm.materialize import load_processor
    from rawmm.serving.guard import WeightsGuard
    from rawmm.serving.images import RequestImages

    try:
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

        from rawmm.serving.vllm_server import VllmArgsError, parse_vllm_args, serve_vllm
    except ImportError as exc:
        raise CliError(f"--engine vllm needs vLLM 0.32 (pip install 'rawmm[inference]'): {exc}") from None
    try:
        vllm_args = parse_vllm_args(
            model=args.model,
            host=args.host,
            port=args.port,
            vllm_args=args.vllm_args,
            mm_cache_bytes=images.cache.max_bytes,
        )
    except VllmArgsError as exc:
        raise CliError(str(exc)) from None

    def images_for(pixels: str) -> RequestImages:
        processor = load_processor(args.model, args.processor_backend, args.trust_remote_code, pixels=pixels)
        return RequestImages(
            processor,
            roots=images.roots,
            cache=images.cache,
            max_pixels=images.max_pixels,
            budget=images.budget,
        )

    cli_env_setup()  # as `vllm serve` does: spawn (not fork) the engine-core processes
    asyncio.run(serve_vllm(vllm_args, images_for=images_for, guard=WeightsGuard.from_env(args.weights_root)))
    return 0
