"""The four weight-transfer routes (rawmm.contract.weight_transfer), behind the weights guard.

Every step is authorized as ``/v1/rawmm/weights`` is: the token is checked before the body is read, and an
engine without a token or weights root refuses them all. An update is never cancelled by its client going
away: a receive that stopped midway would leave the engine's weights half new.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rawmm.contract.engine_api import WeightsResponse
from rawmm.contract.weight_transfer import (
    FINISH_PATH,
    INIT_PATH,
    START_PATH,
    UPDATE_PATH,
    FinishRequest,
    InitRequest,
    InitResponse,
    UpdateRequest,
)
from rawmm.serving import metrics
from rawmm.serving.engine import Engine, InvalidRequest
from rawmm.serving.guard import WeightsGuard, WeightsRefused

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)


def build_weight_transfer_router(
    engine: Engine,
    guard: WeightsGuard,
    *,
    parse: Callable[[Request, type[BaseModel]], Awaitable[Any]],
    refused: Callable[[WeightsRefused], JSONResponse],
    invalid: Callable[[InvalidRequest], JSONResponse],
    failed: Callable[[str], JSONResponse],
) -> APIRouter:
    """The routes over ``engine``; the body parser and error responses are the rawmm routes' own."""
    router = APIRouter()

    async def step(
        request: Request, model: type[BaseModel] | None, name: str, run: Callable[[Any], Any]
    ) -> Any:
        try:
            guard.authorize(request.headers.get("authorization"))
        except WeightsRefused as exc:
            return refused(exc)
        body = None
        if model is not None:
            body = await parse(request, model)
            if isinstance(body, JSONResponse):
                return body
        try:
            return await run(body)
        except InvalidRequest as exc:
            log.warning("weight transfer %s refused: %s", name, exc)
            return invalid(exc)
        except Exception:
            log.exception("weight transfer %s failed", name)
            return failed(f"the engine failed the weight transfer step {name!r}; see its log")

    @router.post(INIT_PATH)
    async def init(request: Request) -> Any:
        async def run(body: InitRequest) -> dict[str, str]:
            served = await engine.init_weight_transfer(body.init_info)
            return InitResponse(served_dtype=served).model_dump()

        return await step(request, InitRequest, "init", run)

    @router.post(START_PATH)
    async def start(request: Request) -> Any:
        async def run(_: None) -> dict[str, str]:
            await engine.start_weight_update()
            return {"message": "weight update started"}

        return await step(request, None, "start", run)

    @router.post(UPDATE_PATH)
    async def update(request: Request) -> Any:
        async def run(body: UpdateRequest) -> dict[str, str]:
            await engine.update_weights(body.update_info)
            return {"message": "weights updated"}

        return await step(request, UpdateRequest, "update", run)

    @router.post(FINISH_PATH, response_model=WeightsResponse)
    async def finish(request: Request) -> Any:
        async def run(body: FinishRequest) -> WeightsResponse:
            version = await engine.finish_weight_update()
            metrics.ENGINE_WEIGHTS_VERSION.set(version)
            log.info("weights broadcast %s finished: weights_version %d", body.weight_version, version)
            return WeightsResponse(weights_version=version)

        return await step(request, FinishRequest, "finish", run)

    return router
