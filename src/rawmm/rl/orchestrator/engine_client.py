"""HTTP client for one engine replica's rawmm API, with retries where retrying can help.

- Down (connection refused, reset, timeout) or 5xx: retried with exponential backoff; after the last
  attempt `ReplicaUnavailable` (the pool then fails over to another replica).
- 400 `invalid_mm_image_ref`: `InvalidRefError` at once. The ref will not get better by asking again.
- Any other 4xx: `RequestRejected` at once.
Weight updates carry `Authorization: Bearer $RAWMM_WEIGHTS_TOKEN` (rawmm.contract.weights_token).
Every failed attempt is counted in `rawmm_engine_request_errors_total{kind}` and logged.
Requests, responses and error bodies are the server's own models (`rawmm.contract.engine_api`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from rawmm.contract.engine_api import (
    GENERATE_PATH,
    HEALTH_PATH,
    WEIGHTS_PATH,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    WeightsRequest,
    WeightsResponse,
)
from rawmm.contract.weights_token import auth_headers
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics

log = logging.getLogger(__name__)


class EngineError(Exception):
    """An engine request that did not produce a result."""


class InvalidRefError(EngineError):
    def __init__(self, url: str, reason: str, message: str) -> None:
        super().__init__(f"{url} rejected an image ref ({reason}): {message}")
        self.url, self.reason, self.message = url, reason, message


class RequestRejected(EngineError):
    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} rejected the request with HTTP {status}: {body[:500]}")
        self.url, self.status = url, status


class ReplicaUnavailable(EngineError):
    def __init__(self, url: str, attempts: int, last_error: str) -> None:
        super().__init__(f"engine {url} unavailable after {attempts} attempts: {last_error}")
        self.url = url


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.initial_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class EngineClient:
    """Talks to engine replicas by URL; one instance serves every replica of a run."""

    def __init__(
        self, http: httpx.AsyncClient, metrics: OrchestratorMetrics, retry: RetryPolicy = RetryPolicy()
    ) -> None:
        self._http, self._metrics, self._retry = http, metrics, retry

    async def generate(self, url: str, request: GenerateRequest) -> GenerateResponse:
        """A generation with one logprob per token (`request` must ask for logprobs)."""
        data = await self._post(url, GENERATE_PATH, request)
        try:
            generation = GenerateResponse.model_validate(data)
        except ValidationError as exc:
            self._metrics.engine_errors.labels(kind="bad_response").inc()
            raise RequestRejected(url, 200, f"malformed generate response: {exc!r}") from exc
        logprobs = generation.logprobs
        if logprobs is None or len(logprobs) != len(generation.token_ids):
            self._metrics.engine_errors.labels(kind="bad_response").inc()
            got = "no" if logprobs is None else len(logprobs)
            raise RequestRejected(url, 200, f"{got} logprobs for {len(generation.token_ids)} tokens")
        return generation

    async def load_weights(self, url: str, path: str) -> int:
        data = await self._post(url, WEIGHTS_PATH, WeightsRequest(path=path), headers=auth_headers())
        return WeightsResponse.model_validate(data).weights_version

    async def health(self, url: str) -> int:
        """The replica's weights version if it answers healthy right now (one attempt, no retry)."""
        response = await self._http.get(f"{url}{HEALTH_PATH}")
        response.raise_for_status()
        return HealthResponse.model_validate(response.json()).weights_version

    async def _post(
        self, url: str, route: str, request: BaseModel, headers: dict[str, str] | None = None
    ) -> Any:
        body = request.model_dump(mode="json")
        last_error = ""
        for attempt in range(1, self._retry.attempts + 1):
            try:
                response = await self._http.post(f"{url}{route}", json=body, headers=headers)
            except httpx.TimeoutException as exc:
                kind, last_error = "timeout", f"timed out ({type(exc).__name__})"
            except httpx.TransportError as exc:
                kind, last_error = "unreachable", f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        kind, last_error = "bad_response", f"HTTP {response.status_code} with a non-JSON body"
                elif response.status_code >= 500:
                    kind, last_error = "server_error", f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    raise self._client_error(url, response)
            self._metrics.engine_errors.labels(kind=kind).inc()
            if attempt < self._retry.attempts:
                delay = self._retry.backoff(attempt)
                log.warning(
                    "engine %s%s: %s (attempt %d/%d), retrying in %.2fs",
                    url,
                    route,
                    last_error,
                    attempt,
                    self._retry.attempts,
                    delay,
                )
                await asyncio.sleep(delay)
        log.error(
            "engine %s%s: %s; giving up after %d attempts", url, route, last_error, self._retry.attempts
        )
        raise ReplicaUnavailable(url, self._retry.attempts, last_error)

    def _client_error(self, url: str, response: httpx.Response) -> EngineError:
        try:
            error = ErrorResponse.model_validate_json(response.content).error
        except ValidationError:
            error = None  # not the server's error shape (a proxy's page, say): rejected as it stands
        if error is not None and error.type == "invalid_mm_image_ref":
            self._metrics.engine_errors.labels(kind="invalid_ref").inc()
            return InvalidRefError(url, error.reason, error.message)
        self._metrics.engine_errors.labels(kind="rejected").inc()
        return RequestRejected(url, response.status_code, response.text)
