"""`rawmm serve`: an engine replica that takes raw image refs (transformers on CPU, or vLLM)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rawmm.cli import CliError

if TYPE_CHECKING:
    from rawmm.materialize import LoadedProcessor
    from rawmm.serving.images import RequestImages

CACHE_SIZE_ENV = "RAWMM_MATERIALIZE_CACHE_SIZE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (or hub id) to serve")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
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
    parser.add_argument("--processor-backend", choices=("pil", "torchvision"), default="pil")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="refuse images larger than this (decompression bombs)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "vllm_args", nargs="*", help="after `--`: extra arguments for vLLM's server (--engine vllm only)"
    )


def run(args: argparse.Namespace) -> int:
    from rawmm.quantity import parse_byte_size

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
    if args.vllm_args and args.engine != "vllm":
        raise CliError(f"extra arguments {args.vllm_args} are for --engine vllm only")

    from rawmm.materialize import DEFAULT_MAX_IMAGE_PIXELS, MaterializeCache, load_processor
    from rawmm.serving.images import RequestImages

    try:
        processor = load_processor(args.model, args.processor_backend, args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load the image processor of {args.model}: {exc}") from None
    images = RequestImages(
        processor,
        roots=args.offload_root,
        cache=MaterializeCache(cache_bytes),
        max_pixels=args.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS,
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
        return _serve_vllm(args, processor, images)
    return _serve_transformers(args, processor, images)


def _serve_transformers(args: argparse.Namespace, processor: LoadedProcessor, images: RequestImages) -> int:
    import asyncio

    import uvicorn

    from rawmm.serving.routes import create_app
    from rawmm.serving.transformers_engine import TransformersEngine

    try:
        engine = TransformersEngine(args.model, processor)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load {args.model}: {exc}") from None
    app = create_app(engine, images)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        asyncio.run(engine.close())
    return 0


def _serve_vllm(args: argparse.Namespace, processor: LoadedProcessor, images: RequestImages) -> int:
    import asyncio

    try:
        from rawmm.serving.vllm_engine import serve_vllm
    except ImportError as exc:
        raise CliError(
            f"--engine vllm needs vLLM 0.33 with its GPU stack (pip install 'rawmm[inference]'): {exc}"
        ) from None
    asyncio.run(
        serve_vllm(
            model=args.model,
            host=args.host,
            port=args.port,
            processor=processor,
            images=images,
            vllm_args=args.vllm_args,
        )
    )
    return 0
