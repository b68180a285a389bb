"""The rawmm HTTP routes of an engine replica, and how errors become responses.

Weights arrive by checkpoint (``/v1/rawmm/weights``) or by broadcast (``rawmm.serving.weight_transfer_routes``).

Client errors never become a 500, and every 4xx body is ``{"error": {"type", "reason", "message"}}`` with a
stable snake_case ``reason``: a bad image ref is a 400 ``invalid_mm_image_ref`` (reasons of
docs/architecture.md §3.5, counted in ``rawmm_invalid_mm_image_ref_total{reason}``); a malformed body or an
impossible prompt is a 400 ``invalid_request`` (``invalid_json``, ``invalid_body``, ``body_too_large`` (413),
``token_out_of_vocabulary``, ``prompt_too_long``, and the weights reasons); a weights request the guard turns
away is a 403 ``weights_refused`` (``weights_disabled``, ``missing_token``, ``invalid_token``,
``outside_weights_root``), counted in ``rawmm_weights_refused_total{reason}``. Only a genuine server fault
is a 500.

A generate request whose client disconnects before its response is cancelled (``until_disconnected``): its
materializations stop waiting (one shared with another request goes on for it), its items' leases are
released and the engine abandons its generation (vLLM aborts it); it is counted as
``rawmm_engine_requests_total{status="cancelled"}``. A weight update always runs to its end.

The routes are the same on our own app (the transformers engine) and mounted on vLLM's OpenAI server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rawmm.contract import InvalidImageRef
from rawmm.contract.engine_api import (
    GENERATE_PATH,
    HEALTH_PATH,
    WEIGHTS_PATH,
    ErrorDetail,
    ErrorResponse,
    ErrorType,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    WeightsRequest,
    WeightsResponse,
)
from rawmm.materialize import metrics as materialize_metrics
from rawmm.serving import metrics
from rawmm.serving.engine import Engine, EngineUnavailable, InvalidRequest
from rawmm.serving.guard import WEIGHTS_DISABLED, WeightsGuard, WeightsRefused
from rawmm.serving.images import RequestImages
from rawmm.serving.weight_transfer_routes import build_weight_transfer_router

log = logging.getLogger(__name__)

T = TypeVar("T")

# A generate body is token ids plus small refs (a 32k-token prompt with 100 images is under 1 MiB); anything
# far larger is refused before it is read into memory.
MAX_BODY_BYTES = 16 * 1024 * 1024


def _error(status: int, kind: ErrorType, reason: str, message: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(type=kind, reason=reason, message=message))
    return JSONResponse(status_code=status, content=body.model_dump())


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()[:5]
    )


async def _read_body(request: Request) -> bytes | JSONResponse:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return _error(413, "invalid_request", "body_too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return _error(
                413, "invalid_request", "body_too_large", f"the body is over {MAX_BODY_BYTES} bytes"
            )
    return bytes(body)


async def _parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The body as ``model``, or a 4xx ``invalid_request`` response. Parsed here rather than by FastAPI so the
    routes answer the same on our app and on vLLM's (whose validation handler would answer its own way)."""
    body = await _read_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        reason = "invalid_json" if any(e["type"] == "json_invalid" for e in exc.errors()) else "invalid_body"
        return _error(400, "invalid_request", reason, _validation_message(exc))


def invalid_ref_response(exc: InvalidImageRef) -> JSONResponse:
    materialize_metrics.INVALID_MM_IMAGE_REF.labels(reason=exc.reason).inc()
    return _error(400, "invalid_mm_image_ref", exc.reason, exc.message)


def invalid_request_response(exc: InvalidRequest) -> JSONResponse:
    return _error(400, "invalid_request", exc.reason, str(exc))


def weights_refused_response(exc: WeightsRefused) -> JSONResponse:
    metrics.WEIGHTS_REFUSED.labels(reason=exc.reason).inc()
    log.warning("weights request refused: %s", exc)
    return _error(exc.status, "weights_refused", exc.reason, exc.message)


async def _disconnect(request: Request) -> None:
    """Return when the ASGI server reports the client gone. Only once the body has been read: every message
    this consumes is lost to the route (after the body, the server has only ``http.disconnect`` to send)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; ``ClientDisconnect`` when the client goes away first, once ``work`` is cancelled and
    settled (its image leases released, its engine request aborted).

    The disconnect is the ASGI ``http.disconnect`` message, awaited as Starlette's ``StreamingResponse`` does:
    it arrives the moment the server sees the connection close, costs nothing meanwhile, and passes through
    Starlette's ``BaseHTTPMiddleware``, where ``Request.is_disconnected()`` (a poll, besides) can miss it.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself cancelled (server shutdown): so is the work
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():  # also when both finished at once: the response is ready
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnect()


def build_router(engine: Engine, images: RequestImages, guard: WeightsGuard = WEIGHTS_DISABLED) -> APIRouter:
    """The rawmm routes over ``engine``: generate, weights (behind ``guard``), health, metrics."""
    router = APIRouter()

    async def serve_generate(body: GenerateRequest) -> Any:
        try:
            engine.check_request(body.prompt_token_ids, body.sampling)
            parsed = images.parse(body.features, body.prompt_token_ids, engine.placeholder_token_id)
            async with images.hold(parsed) as inputs:  # the items stay accounted until the response
                generation = await engine.generate(body.prompt_token_ids, inputs, body.sampling)
        except InvalidImageRef as exc:
            metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
            return invalid_ref_response(exc)
        except InvalidRequest as exc:
            metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
            return invalid_request_response(exc)
        except EngineUnavailable as exc:
            metrics.ENGINE_REQUESTS.labels(status="error").inc()
            log.error("generate failed: %s", exc)
            return _error(503, "engine_unavailable", "engine_unavailable", str(exc))
        except Exception:
            metrics.ENGINE_REQUESTS.labels(status="error").inc()
            log.exception("generate failed")
            return _error(
                500,
                "internal_error",
                "internal_error",
                "the engine failed to serve this request; see its log",
            )
        metrics.ENGINE_REQUESTS.labels(status="ok").inc()
        metrics.ENGINE_GENERATED_TOKENS.inc(len(generation.token_ids))
        return GenerateResponse(
            token_ids=generation.token_ids,
            logprobs=generation.logprobs if body.sampling.logprobs else None,
            finish_reason=generation.finish_reason,
            weights_version=generation.weights_version,
        )

    @router.post(GENERATE_PATH, response_model=GenerateResponse)
    async def generate(request: Request) -> Any:
        try:
            body = await _parse_body(request, GenerateRequest)
            if isinstance(body, JSONResponse):
                metrics.ENGINE_REQUESTS.labels(status="invalid").inc()
                return body
            return await until_disconnected(request, serve_generate(body))
        except ClientDisconnect:  # while it sent the body, or before its response
            metrics.ENGINE_REQUESTS.labels(status="cancelled").inc()
            log.info("generate cancelled: the client disconnected before the response")
            # Nobody reads it; 499 is the access logs' "client closed request".
            return _error(499, "invalid_request", "client_disconnected", "the client disconnected")

    @router.post(WEIGHTS_PATH, response_model=WeightsResponse)
    async def load_weights(request: Request) -> Any:
        # Authorize before reading the body: an unauthorized caller learns nothing about paths.
        try:
            guard.authorize(request.headers.get("authorization"))
        except WeightsRefused as exc:
            return weights_refused_response(exc)
        body = await _parse_body(request, WeightsRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            path = guard.confine(body.path)
            version = await engine.load_weights(str(path))
        except WeightsRefused as exc:
            return weights_refused_response(exc)
        except InvalidRequest as exc:
            return invalid_request_response(exc)
        except Exception:
            log.exception("loading weights from %s failed", body.path)
            return _error(
                500,
                "internal_error",
                "internal_error",
                "the engine failed to load these weights; see its log",
            )
        metrics.ENGINE_WEIGHTS_VERSION.set(version)
        log.info("loaded weights from %s: weights_version %d", path, version)
        return WeightsResponse(weights_version=version)

    @router.get(HEALTH_PATH, response_model=HealthResponse)
    async def health() -> Any:
        try:
            await engine.check_health()
        except Exception as exc:
            log.error("health check failed: %r", exc)
            return JSONResponse(status_code=503, content={"status": "unhealthy", "message": repr(exc)})
        return HealthResponse(status="ok", weights_version=engine.weights_version)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    def failed(message: str) -> JSONResponse:
        return _error(500, "internal_error", "internal_error", message)

    router.include_router(
        build_weight_transfer_router(
            engine,
            guard,
            parse=_parse_body,
            refused=weights_refused_response,
            invalid=invalid_request_response,
            failed=failed,
        )
    )
    return router


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 4xx (unknown route, wrong method) in the same shape as ours."""
    assert isinstance(exc, HTTPException)
    reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(exc.status_code, "invalid_request", reason, str(exc.detail))


def create_app(engine: Engine, images: RequestImages, guard: WeightsGuard) -> FastAPI:
    """The standalone rawmm server app (the transformers engine); vLLM mounts the same router on its own app."""
    metrics.register_engine_metrics()
    metrics.ENGINE_WEIGHTS_VERSION.set(engine.weights_version)
    app = FastAPI(title="rawmm engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_router(engine, images, guard))
    app.add_exception_handler(HTTPException, _http_error)
    return app
