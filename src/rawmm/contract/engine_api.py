"""The engine replica's rawmm HTTP API: its routes and every body, for the server and its clients alike.

The server (`rawmm.serving.routes`) parses requests and writes responses with these models, and the
orchestrator's client (`rawmm.rl.orchestrator.engine_client`) builds requests and parses responses with the
same ones, so the two cannot drift apart. Every 4xx/5xx body of generate and weights is an `ErrorResponse`;
`/health` answers a `HealthResponse`, or 503 with the engine's failure.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

GENERATE_PATH = "/v1/rawmm/generate"
WEIGHTS_PATH = "/v1/rawmm/weights"
HEALTH_PATH = "/health"
# The sampling limits a request may ask for; the run config's sampling section refuses more up front.
MAX_TOKENS_LIMIT = 65536
# Seeds are int64s (vLLM's, torch's generators), never negative.
SEED_LIMIT = 2**63
TEMPERATURE_LIMIT = 100.0
# The lowest temperature above 0 (greedy) a request may ask for, whichever the engine: vLLM raises lower ones to
# this with only a warning, and far lower ones overflow ``logits / temperature`` in float32 (the transformers
# engine's sampling and the trainer's logprobs alike). Refused by the engines and, up front, by the run config.
MIN_TEMPERATURE = 0.01


def temperature_problem(temperature: float) -> str | None:
    """Why ``temperature`` cannot be sampled at (``None`` when it can)."""
    if 0 < temperature < MIN_TEMPERATURE:
        return f"temperature {temperature} is below the minimum {MIN_TEMPERATURE} (0 means greedy)"
    return None


# `invalid_mm_image_ref`: a bad image ref (reasons in rawmm.contract.errors); `invalid_request`: any other
# client error; `weights_refused`: the weights guard said no; the last two are the server's own faults.
ErrorType = Literal[
    "invalid_mm_image_ref", "invalid_request", "weights_refused", "engine_unavailable", "internal_error"
]


class Sampling(BaseModel):
    """How to sample. ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible per request."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=TEMPERATURE_LIMIT)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    logprobs: bool = True


class GenerateRequest(BaseModel):
    """Token ids with image placeholders, the request features of its images (docs/architecture.md §3.3),
    sampling."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    features: dict[str, Any] | None = None
    sampling: Sampling = Field(default_factory=Sampling)


class GenerateResponse(BaseModel):
    token_ids: list[int]
    # Per generated token, the log-probability under the distribution it was sampled from (after
    # temperature and top-p; vLLM's ``processed_logprobs``). None when the request asked for none.
    logprobs: list[float] | None
    finish_reason: Literal["stop", "length"]
    weights_version: int


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)


class WeightsResponse(BaseModel):
    weights_version: int


class HealthResponse(BaseModel):
    """A healthy replica's answer; an unhealthy one answers 503."""

    status: Literal["ok"]
    weights_version: int


class ErrorDetail(BaseModel):
    type: ErrorType
    reason: str  # a stable snake_case name clients branch on
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
