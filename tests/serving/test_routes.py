"""The routes on a real uvicorn on 127.0.0.1, in process, over a stand-in engine: a generate request whose client
hangs up is cancelled (its engine call, its materializations, its leases), and no other request with it; an
engine that fails a weight update unexpectedly still answers an error body."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from PIL import Image
from prometheus_client import REGISTRY
from serve_harness import poll, request_in_flight

from rawmm.contract import FeatureImage, OffloadStore, describe_stored_image, encode_ref, parse_ref
from rawmm.contract.engine_api import GENERATE_PATH, WEIGHTS_PATH, Sampling
from rawmm.materialize import MaterializeCache, load_processor
from rawmm.serving import images as images_module
from rawmm.serving.engine import Engine, Generation, ImageInput
from rawmm.serving.guard import WEIGHTS_DISABLED, WeightsGuard
from rawmm.serving.images import RequestImages
from rawmm.serving.routes import create_app

ENDLESS = 1000  # max_tokens that make the stand-in engine generate until it is cancelled
PLACEHOLDER = 3


class StandInEngine(Engine):
    """Answers ``max_tokens`` sevens at once, or, at ``ENDLESS``, generates until it is cancelled."""

    def __init__(self, processor: Any) -> None:
        super().__init__()
        self.processor = processor
        self.placeholder_token_id = PLACEHOLDER
        self.vocab_size = 100
        self.max_model_len = 4096
        self.running = 0
        self.cancelled = 0

    async def check_health(self) -> None:
        pass

    async def generate(self, token_ids: list[int], images: Sequence[ImageInput], sampling: Sampling) -> Any:
        if sampling.max_tokens != ENDLESS:
            return Generation([7] * sampling.max_tokens, [-1.0] * sampling.max_tokens, "length", 0)
        self.running += 1
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def load_weights(self, path: str) -> int:
        raise RuntimeError("the stand-in engine cannot load weights")

    async def close(self) -> None:
        pass


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` on uvicorn at 127.0.0.1 in a thread; stopped on exit (requests still open: after 5 s)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        poll(lambda: server.started, "uvicorn started", timeout_s=30)
        (port,) = {sock.getsockname()[1] for s in server.servers for sock in s.sockets}
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def cancelled_requests() -> float:
    return REGISTRY.get_sample_value("rawmm_engine_requests_total", {"status": "cancelled"}) or 0.0


@pytest.fixture
def store(tmp_path: Path) -> OffloadStore:
    return OffloadStore(tmp_path / "offload")


@pytest.fixture
def request_images(tiny_qwen2_vl: Path, store: OffloadStore) -> RequestImages:
    loaded = load_processor(tiny_qwen2_vl)
    return RequestImages(loaded, roots=[store.root], cache=MaterializeCache(10**9), max_pixels=10**8)


def an_image(store: OffloadStore, loaded: Any, offset: int = 2) -> FeatureImage:
    stored = store.put(Image.new("RGB", (64, 48), (20, 120, 200)))
    descriptor, layout = describe_stored_image(
        loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
    )
    ref = parse_ref(encode_ref(descriptor, stored.mm_hash))
    return FeatureImage("image", ref, offset, layout.num_placeholder_tokens)


def body(max_tokens: int, images: Sequence[FeatureImage] = ()) -> dict[str, Any]:
    """A prompt of text tokens around ``images`` (at their offsets)."""
    token_ids = [5] * (images[-1].offset + images[-1].length + 3 if images else 4)
    features: dict[str, Any] = {"mm_hashes": {"image": []}, "mm_placeholders": {"image": []}}
    features["kwargs_data"] = {"image": []}
    for image in images:
        token_ids[image.offset : image.offset + image.length] = [PLACEHOLDER] * image.length
        features["mm_hashes"]["image"].append(image.ref.mm_hash)
        features["mm_placeholders"]["image"].append({"offset": image.offset, "length": image.length})
        features["kwargs_data"]["image"].append(encode_ref(image.ref.descriptor(), image.ref.mm_hash))
    return {
        "prompt_token_ids": token_ids,
        "features": features if images else None,
        "sampling": {"max_tokens": max_tokens},
    }


def test_a_client_that_hangs_up_cancels_its_generation_and_no_other(request_images: RequestImages) -> None:
    engine = StandInEngine(request_images.processor)
    with serving(create_app(engine, request_images, WEIGHTS_DISABLED)) as url:
        cancelled = cancelled_requests()
        with request_in_flight(url, GENERATE_PATH, body(ENDLESS)):
            poll(lambda: engine.running == 1, "the endless generation running")
            other = httpx.post(f"{url}{GENERATE_PATH}", json=body(3), timeout=30.0)
            assert other.status_code == 200, other.text  # served while the first one generates
            assert other.json()["token_ids"] == [7, 7, 7]
        poll(lambda: engine.cancelled == 1 and engine.running == 0, "the generation cancelled")
        poll(lambda: cancelled_requests() - cancelled == 1, "the cancel counted")
        after = httpx.post(f"{url}{GENERATE_PATH}", json=body(2), timeout=30.0)
        assert after.status_code == 200 and after.json()["token_ids"] == [7, 7]


def test_a_client_that_hangs_up_mid_body_is_counted_as_cancelled(request_images: RequestImages) -> None:
    with serving(
        create_app(StandInEngine(request_images.processor), request_images, WEIGHTS_DISABLED)
    ) as url:
        cancelled = cancelled_requests()
        head = f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
        address = httpx.URL(url)
        with socket.create_connection((address.host, address.port), timeout=30) as sock:
            sock.sendall(head.encode() + b'{"prompt_token_ids": [')
        poll(lambda: cancelled_requests() - cancelled == 1, "the request counted as cancelled")


def test_a_hung_up_request_leaves_a_shared_materialization_to_the_others(
    request_images: RequestImages, store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests wait for one image's single materialization; the one that started it hangs up: the work
    goes on for the other, which gets the item, and the cancelled request's lease on it ends."""
    materializing, release = threading.Event(), threading.Event()
    real = images_module.materialize_engine_item

    def gated(*args: Any, **kwargs: Any) -> Any:
        materializing.set()
        assert release.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(images_module, "materialize_engine_item", gated)
    image = an_image(store, request_images.processor)
    cache = request_images.cache
    with (
        serving(create_app(StandInEngine(request_images.processor), request_images, WEIGHTS_DISABLED)) as url,
        ThreadPoolExecutor(1) as pool,
    ):
        cancelled = cancelled_requests()
        with request_in_flight(url, GENERATE_PATH, body(3, [image])):
            poll(materializing.is_set, "the first request's materialization started")
            other = pool.submit(httpx.post, f"{url}{GENERATE_PATH}", json=body(3, [image]), timeout=60.0)
            poll(lambda: cache.stats.inflight_joins == 1, "the second request joined it")
        poll(lambda: cancelled_requests() - cancelled == 1, "the first request cancelled")
        release.set()
        response = other.result(timeout=60)
    assert response.status_code == 200, response.text
    assert (cache.stats.misses, cache.stats.inflight_joins) == (1, 1)  # one materialization, not restarted
    assert len(cache) == 1 and cache.pinned_bytes == 0  # cached, held by no lease


def test_a_weight_update_the_engine_fails_unexpectedly_is_a_500_with_an_error_body(
    request_images: RequestImages, tmp_path: Path
) -> None:
    guard = WeightsGuard(token="t", root=tmp_path.resolve())
    app = create_app(StandInEngine(request_images.processor), request_images, guard)
    with serving(app) as url:
        response = httpx.post(
            url + WEIGHTS_PATH, json={"path": str(tmp_path)}, headers={"Authorization": "Bearer t"}
        )
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error", response.text
