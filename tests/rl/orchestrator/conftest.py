"""A scriptable fake engine replica speaking the rawmm HTTP API (its routes and bodies from
rawmm.contract.engine_api, as the real server's), served on 127.0.0.1 inside the test's event loop, for the
orchestrator's retry, failover, invalid-ref and pinning logic."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rawmm.contract.engine_api import (
    GENERATE_PATH,
    HEALTH_PATH,
    WEIGHTS_PATH,
    ErrorDetail,
    ErrorResponse,
    GenerateResponse,
    HealthResponse,
    WeightsRequest,
    WeightsResponse,
)


@dataclass
class FakeEngine:
    """Answers generate with `reply(body)` token ids; `fail_next` 503s first; a request for which
    `reject(body)` names a reason gets a 400 invalid ref. Records every request body."""

    reply: Callable[[dict[str, Any]], list[int]] = lambda body: [5, 6, 7]
    fail_next: int = 0
    reject: Callable[[dict[str, Any]], str | None] = lambda body: None
    weights_version: int = 0
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # "generate" / "weights", in arrival order
    weights_paths: list[str] = field(default_factory=list)
    server: uvicorn.Server | None = None
    task: asyncio.Task[None] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post(GENERATE_PATH)
        async def generate(request: Request) -> JSONResponse:
            body = await request.json()
            self.generate_bodies.append(body)
            self.calls.append("generate")
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"detail": "overloaded"}, status_code=503)
            reason = self.reject(body)
            if reason is not None:
                error = ErrorDetail(type="invalid_mm_image_ref", reason=reason, message="bad ref")
                return JSONResponse(ErrorResponse(error=error).model_dump(), status_code=400)
            tokens = self.reply(body)
            generation = GenerateResponse(
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                finish_reason="stop",
                weights_version=self.weights_version,
            )
            return JSONResponse(generation.model_dump())

        @app.post(WEIGHTS_PATH)
        async def weights(request: Request) -> JSONResponse:
            self.weights_paths.append(WeightsRequest.model_validate(await request.json()).path)
            self.calls.append("weights")
            self.weights_version += 1
            return JSONResponse(WeightsResponse(weights_version=self.weights_version).model_dump())

        @app.get(HEALTH_PATH)
        async def health() -> JSONResponse:
            return JSONResponse(
                HealthResponse(status="ok", weights_version=self.weights_version).model_dump()
            )

        return app

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        # The socket is listening before serve() runs, so clients can connect at once.
        sock.listen(64)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    async def stop(self) -> None:
        """Stop serving: later connections are refused (the replica is down)."""
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, timeout=10)
            self.server = self.task = None


@pytest.fixture
async def fake_engines() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started fake engines; all are stopped at teardown."""
    engines: list[FakeEngine] = []

    async def make(**kwargs: Any) -> FakeEngine:
        engine = FakeEngine(**kwargs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        with contextlib.suppress(Exception):
            await engine.stop()
