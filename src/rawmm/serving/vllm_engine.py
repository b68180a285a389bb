"""vLLM 0.33 integration: our routes on vLLM's OpenAI server, our items fed to its engine as-is.

Each request's materialized items become ``MultiModalKwargsItem``s under the engine modality key
(``image``; Kimi: ``vision_chunk``), with one field element per tensor shaped the way vLLM's own
processors shape them (pixels flat, one row per patch; grids batched and kept on CPU). They enter the
engine through ``mm_input`` with the refs' content hashes and the placeholder ranges, so vLLM skips its
own processing; its processor and encoder caches key on the same content hashes. Weight updates reload
in place from the checkpoint directory (``reload_weights``) while no generation runs, then drop the
prefix cache, whose KV entries belong to the old weights.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from vllm.inputs import mm_input, tokens_input
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalKwargsItems,
    PlaceholderRange,
)
from vllm.sampling_params import RequestOutputKind, SamplingParams

from rawmm.materialize import EngineItem, FieldKind, LoadedProcessor, get_adapter
from rawmm.serving.engine import Engine, Generation, ImageInput, InvalidRequest
from rawmm.serving.images import RequestImages
from rawmm.serving.routes import build_router
from rawmm.serving.schemas import Sampling

log = logging.getLogger(__name__)


def to_vllm_item(item: EngineItem) -> MultiModalKwargsItem:
    """One engine item as vLLM's per-item kwargs (the same elements its own processors would build)."""
    elems = {}
    for key, tensor in item.tensors.items():
        if item.kinds[key] is FieldKind.FLAT:
            field: Any = MultiModalFlatField(slices=[slice(0, tensor.shape[0])], dim=0)
        else:
            # Our batched fields are the per-image grids: vLLM's Qwen and Kimi processors keep them on CPU.
            field = MultiModalBatchedField(keep_on_cpu=True)
        elems[key] = MultiModalFieldElem(data=tensor, field=field)
    return MultiModalKwargsItem(elems)


def vision_token_count(image: ImageInput, processor: LoadedProcessor) -> int:
    """Embeddings the vision tower emits for one image: grid patches / merge²."""
    grid = image.item.tensors[get_adapter(processor.family.name).grid_key]
    return int(grid.prod()) // processor.config.merge_size**2


def build_engine_input(token_ids: list[int], images: Sequence[ImageInput], processor: LoadedProcessor) -> Any:
    """vLLM's engine input for a prompt and its materialized images (prompt order).

    vLLM wants one placeholder token per vision embedding. Qwen prompts already hold that many; a Kimi
    prompt holds one ``<|media_pad|>`` per image (DESIGN §3.4), which is expanded here as vLLM's own
    Kimi-K2.5 processor would, shifting every later offset.
    """
    if not images:
        return tokens_input(list(token_ids))
    prompt: list[int] = []
    kwargs: dict[str, list[MultiModalKwargsItem]] = {}
    hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[PlaceholderRange]] = {}
    cursor = 0
    for image in sorted(images, key=lambda image: image.feature.offset):
        feature = image.feature
        prompt.extend(token_ids[cursor : feature.offset])
        length = vision_token_count(image, processor)
        placeholders.setdefault(feature.modality, []).append(
            PlaceholderRange(offset=len(prompt), length=length)
        )
        prompt.extend([token_ids[feature.offset]] * length)
        cursor = feature.offset + feature.length
        kwargs.setdefault(feature.modality, []).append(to_vllm_item(image.item))
        hashes.setdefault(feature.modality, []).append(feature.ref.mm_hash)
    prompt.extend(token_ids[cursor:])
    return mm_input(
        prompt_token_ids=prompt,
        mm_kwargs=MultiModalKwargsItems(kwargs),
        mm_hashes=hashes,
        mm_placeholders=placeholders,
    )


def to_sampling_params(sampling: Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's own logprob only
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class VllmEngine(Engine):
    """The rawmm engine interface over a running vLLM ``EngineClient`` (``AsyncLLM``)."""

    def __init__(self, client: Any, processor: LoadedProcessor) -> None:
        super().__init__()
        self.client = client
        self.processor = processor
        model_config = client.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
        )
        self.placeholder_token_id = int(tokenizer.convert_tokens_to_ids(processor.family.placeholder_token))

    async def generate(
        self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling
    ) -> Generation:
        async with self.gate.generating() as version:
            final = None
            async for output in self.client.generate(
                build_engine_input(token_ids, images, self.processor),
                to_sampling_params(sampling),
                f"rawmm-{uuid.uuid4().hex}",
            ):
                final = output
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output")
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished the request with {completion.finish_reason!r}")
        generated = list(completion.token_ids)
        logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(generated)]
        return Generation(generated, logprobs, completion.finish_reason, version)

    async def load_weights(self, path: str) -> int:
        if not Path(path).is_dir():
            raise InvalidRequest(f"weights path {path!r} is not a checkpoint directory")
        async with self.gate.updating():
            await self.client.collective_rpc("reload_weights", kwargs={"weights_path": path})
            await self.client.reset_prefix_cache()
        return self.gate.version

    async def close(self) -> None:
        """Nothing to release: the vLLM engine client is shut down by the context that made it."""


def mount_routes(app: FastAPI, engine: Engine, images: RequestImages) -> None:
    """Put the rawmm routes in front of vLLM's, replacing its ``/health``. vLLM's own ``/metrics`` stays:
    it serves the default registry, where the rawmm metrics live too (one API server process)."""
    ours = [
        route for route in build_router(engine, images).routes if getattr(route, "path", None) != "/metrics"
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


async def serve_vllm(
    *,
    model: str,
    host: str,
    port: int,
    processor: LoadedProcessor,
    images: RequestImages,
    vllm_args: Sequence[str],
) -> None:
    """Run vLLM's OpenAI server for ``model`` with the rawmm routes mounted (vLLM's own launch sequence)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.common.startup import cli_env_setup
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rawmm import metrics

    cli_env_setup()  # as `vllm serve` does: spawn (not fork) the engine-core processes
    parser = make_arg_parser(FlexibleArgumentParser(prog="rawmm serve --engine vllm"))
    args: argparse.Namespace = parser.parse_args(
        [
            "--model",
            model,
            "--host",
            host,
            "--port",
            str(port),
            "--logprobs-mode",
            "processed_logprobs",
            *vllm_args,
        ]
    )
    validate_parsed_serve_args(args)
    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as client:
            supported_tasks = await client.get_supported_tasks()
            app = build_app(args, supported_tasks, client.model_config)
            await init_app_state(client, app.state, args, supported_tasks)
            engine = VllmEngine(client, processor)
            metrics.register_engine_metrics()
            mount_routes(app, engine, images)
            log.info("rawmm routes mounted on vLLM at %s", listen_address)
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
