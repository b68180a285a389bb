"""The orchestrator's engine client against the engine's real routes (in process, over ASGI): both sides
speak rawmm.contract.engine_api, so a request the client builds is one the server accepts, and a response
or error the server writes is one the client reads. Only the model behind the routes is a stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rawmm.contract.engine_api import (
    GENERATE_PATH,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    Sampling,
)
from rawmm.contract.weights_token import WEIGHTS_TOKEN_ENV
from rawmm.materialize import LoadedProcessor, load_processor
from rawmm.materialize.cache import MaterializeCache
from rawmm.rl.orchestrator.engine_client import EngineClient, InvalidRefError, RequestRejected, RetryPolicy
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics
from rawmm.serving.engine import Engine, Generation, ImageInput
from rawmm.serving.guard import WeightsGuard
from rawmm.serving.images import RequestImages
from rawmm.serving.routes import create_app

URL = "http://engine"
TOKEN = "s3cret"


class Scripted(Engine):
    """Replies `reply` (logprob -0.25 per token) and records every prompt and sampling it was given."""

    def __init__(self, processor: LoadedProcessor, reply: list[int]) -> None:
        super().__init__()
        self.processor, self.reply = processor, reply
        self.placeholder_token_id, self.vocab_size, self.max_model_len = 99, 100, 64
        self.asked: list[tuple[list[int], Sampling]] = []

    async def check_health(self) -> None:
        pass

    async def generate(
        self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling
    ) -> Generation:
        async with self.gate.generating() as version:
            self.asked.append((token_ids, sampling))
            return Generation(self.reply, [-0.25] * len(self.reply), "length", version)

    async def load_weights(self, path: str) -> int:
        async with self.gate.updating():
            pass
        return self.gate.version

    async def close(self) -> None:
        pass


@dataclass
class Served:
    engine: Scripted
    client: EngineClient
    http: httpx.AsyncClient
    weights_root: Path


@pytest.fixture
async def served(
    tiny_qwen2_vl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Served]:
    monkeypatch.setenv(WEIGHTS_TOKEN_ENV, TOKEN)  # what the client sends
    processor = load_processor(tiny_qwen2_vl)
    engine = Scripted(processor, reply=[5, 6])
    images = RequestImages(processor, roots=[tmp_path], cache=MaterializeCache(0), max_pixels=10**6)
    guard = WeightsGuard(token=TOKEN, root=tmp_path.resolve())
    app = create_app(engine, images, guard)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=URL) as http:
        client = EngineClient(http, OrchestratorMetrics(), RetryPolicy(attempts=1))
        yield Served(engine, client, http, tmp_path)


async def test_the_server_reads_the_clients_request_and_the_client_its_response(served: Served) -> None:
    sampling = Sampling(max_tokens=2, temperature=0.5, top_p=0.9, seed=3, logprobs=True)
    generation = await served.client.generate(
        URL, GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)
    )
    assert served.engine.asked == [([1, 2, 3], sampling)]
    assert generation == GenerateResponse(
        token_ids=[5, 6], logprobs=[-0.25, -0.25], finish_reason="length", weights_version=0
    )


async def test_an_invalid_ref_reaches_the_client_with_its_reason(served: Served) -> None:
    features = {
        "mm_hashes": {"image": []},
        "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
        "kwargs_data": {"image": []},
    }
    with pytest.raises(InvalidRefError) as info:
        await served.client.generate(URL, GenerateRequest(prompt_token_ids=[99, 1], features=features))
    assert info.value.reason == "count_mismatch" and served.engine.asked == []


async def test_every_error_body_is_type_reason_message(served: Served) -> None:
    out_of_vocabulary = GenerateRequest(prompt_token_ids=[1000])
    response = await served.http.post(GENERATE_PATH, json=out_of_vocabulary.model_dump(mode="json"))
    assert response.status_code == 400
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["type", "reason", "message"]
    error = ErrorResponse.model_validate(body).error
    assert (error.type, error.reason) == ("invalid_request", "token_out_of_vocabulary")
    with pytest.raises(RequestRejected) as info:
        await served.client.generate(URL, out_of_vocabulary)
    assert info.value.status == 400


async def test_weights_and_health_round_trip(served: Served) -> None:
    checkpoint = served.weights_root / "step_1"
    checkpoint.mkdir()
    assert await served.client.health(URL) == 0
    assert await served.client.load_weights(URL, str(checkpoint)) == 1
    assert await served.client.health(URL) == 1
