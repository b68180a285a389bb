"""The rawmm HTTP routes of an engine replica, and how errors become responses.

Client errors never become a 500: a bad image ref is a 400 ``invalid_mm_image_ref`` with its reason
(counted in ``rawmm_invalid_mm_image_ref_total{reason}``); a malformed body or an impossible prompt is a
400 ``invalid_request``. Only a genuine server fault is a 500.

The routes are the same on our own app (the transformers engine) and mounted on vLLM's OpenAI server.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ValidationError

from rawmm import metrics
from rawmm.contract import InvalidImageRef
from rawmm.serving.engine import Engine, InvalidRequest
from rawmm.serving.images import RequestImages
from rawmm.serving.schemas import GenerateRequest, GenerateResponse, WeightsRequest, WeightsResponse

log = logging.getLogger(__name__)


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"type": kind, **extra, "message": message}})


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()[:5]
    )


async def _parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The body as ``model``, or a 400 ``invalid_request`` response. Parsed here rather than by FastAPI so the
    routes answer the same on our app and on vLLM's (whose validation handler would answer its own way)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        return _error(400, "invalid_request", _validation_message(exc))


def invalid_ref_response(exc: InvalidImageRef) -> JSONResponse:
    metrics.INVALID_MM_IMAGE_REF.labels(reason=exc.reason).inc()
    return _error(400, "invalid_mm_image_ref", exc.message, reason=exc.reason)


def build_router(engine: Engine, images: RequestImages) -> APIRouter:
    """The rawmm routes over ``engine``: generate, weights, health, metrics."""
    router = APIRouter()

    @router.post("/v1/rawmm/generate", response_model=GenerateResponse)
    async def generate(request: Request) -> Any:
        body = await _parse_body(request, GenerateRequest)
        if isinstance(body, JSONResponse):
            metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
            return body
        try:
            engine.check_prompt(body.prompt_token_ids, body.sampling.max_tokens)
            parsed = images.parse(body.features, body.prompt_token_ids, engine.placeholder_token_id)
            inputs = await images.materialize(parsed)
            generation = await engine.generate(body.prompt_token_ids, inputs, body.sampling)
        except InvalidImageRef as exc:
            metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
            return invalid_ref_response(exc)
        except InvalidRequest as exc:
            metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
            return _error(400, "invalid_request", str(exc))
        except Exception:
            metrics.ENGINE_REQUESTS.labels(status="error").inc()
            log.exception("generate failed")
            return _error(500, "internal_error", "the engine failed to serve this request; see its log")
        metrics.ENGINE_REQUESTS.labels(status="ok").inc()
        metrics.ENGINE_GENERATED_TOKENS.inc(len(generation.token_ids))
        return GenerateResponse(
            token_ids=generation.token_ids,
            logprobs=generation.logprobs if body.sampling.logprobs else None,
            finish_reason=generation.finish_reason,
            weights_version=generation.weights_version,
        )

    @router.post("/v1/rawmm/weights", response_model=WeightsResponse)
    async def load_weights(request: Request) -> Any:
        body = await _parse_body(request, WeightsRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            version = await engine.load_weights(body.path)
        except InvalidRequest as exc:
            return _error(400, "invalid_request", str(exc))
        metrics.ENGINE_WEIGHTS_VERSION.set(version)
        log.info("loaded weights from %s: weights_version %d", body.path, version)
        return WeightsResponse(weights_version=version)

    @router.get("/health")
    async def health() -> Any:
        try:
            await engine.check_health()
        except Exception as exc:
            log.error("health check failed: %r", exc)
            return JSONResponse(status_code=503, content={"status": "unhealthy", "message": repr(exc)})
        return {"status": "ok", "weights_version": engine.weights_version}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return router


def create_app(engine: Engine, images: RequestImages) -> FastAPI:
    """The standalone rawmm server app (the transformers engine); vLLM mounts the same router on its own app."""
    metrics.register_engine_metrics()
    metrics.ENGINE_WEIGHTS_VERSION.set(engine.weights_version)
    app = FastAPI(title="rawmm engine", docs_url=None, redoc_url=None)
    app.include_router(build_router(engine, images))
    return app
