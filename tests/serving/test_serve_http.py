"""`rawmm serve --engine transformers` as a real process on 127.0.0.1, serving the tiny Qwen2-VL checkpoint.

One server for the module (start-up is the expensive part); every test reads counter deltas, never
absolute values, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import Server, generate, picture, running_server, user

from rawmm.contract import RawImageDescriptor, encode_ref, get_family, parse_ref

pytestmark = pytest.mark.slow

MAX_IMAGE_PIXELS = 250_000  # the server's decompression-bomb limit in these tests


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    serve_args = ["--engine", "transformers", "--materialize-cache-size", "256Mi",
                  "--max-image-pixels", str(MAX_IMAGE_PIXELS)]  # fmt: skip
    with running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("serve"), serve_args) as running:
        yield running


def test_a_multi_image_prompt_generates(server: Server) -> None:
    token_ids, features = server.render([user(picture(1), picture(2, 80, 40), "Which shape is red?")])
    assert len(features["kwargs_data"]["image"]) == 2
    response = generate(server, token_ids, features, seed=5)
    assert response.status_code == 200, response.text
    out = response.json()
    assert 1 <= len(out["token_ids"]) <= 6 and len(out["logprobs"]) == len(out["token_ids"])
    assert all(lp <= 0 for lp in out["logprobs"])
    assert out["finish_reason"] in ("stop", "length")
    assert generate(server, token_ids, features, seed=5).json() == out  # seeded: reproducible

    # The pixels reach the model: another picture in the same place changes the distribution.
    other_ids, other_features = server.render([user(picture(3), picture(2, 80, 40), "Which shape is red?")])
    assert other_ids == token_ids
    greedy = [generate(server, ids, feats, temperature=0.0, max_tokens=1).json() for ids, feats in
              ((token_ids, features), (other_ids, other_features))]  # fmt: skip
    assert greedy[0]["logprobs"] != greedy[1]["logprobs"]


def test_multi_turn_requests_materialize_each_image_once(server: Server) -> None:
    hits, misses = (server.metric(f"rawmm_materialize_cache_{k}_total") for k in ("hits", "misses"))
    messages: list[dict[str, Any]] = []
    turns = 4
    for turn in range(turns):
        messages.append(user(picture(100 + turn), f"turn {turn}: what changed?"))
        token_ids, features = server.render(messages)
        assert len(features["kwargs_data"]["image"]) == turn + 1  # every request carries every ref
        response = generate(server, token_ids, features, seed=turn, max_tokens=3)
        assert response.status_code == 200, response.text
        # Special tokens skipped: a sampled <|image_pad|> must not turn into an image marker next turn.
        reply = server.tokenizer.decode(response.json()["token_ids"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    assert server.metric("rawmm_materialize_cache_misses_total") - misses == turns
    assert server.metric("rawmm_materialize_cache_hits_total") - hits == sum(range(turns))  # 0 + 1 + 2 + 3
    assert server.metric("rawmm_materialize_cache_entries") >= turns


# --- every way a ref can be bad (DESIGN §3.5) -------------------------------------------------------------

Mutation = Callable[[Server, list[int], dict[str, Any]], tuple[list[int], dict[str, Any]]]


def with_ref(features: dict[str, Any], **changes: Any) -> dict[str, Any]:
    ref = parse_ref(features["kwargs_data"]["image"][0])
    fields = {**ref.descriptor().to_dict(), **changes}
    mm_hash = fields.pop("mm_hash", ref.mm_hash)
    features["kwargs_data"]["image"][0] = encode_ref(RawImageDescriptor.from_dict(fields), mm_hash)
    features["mm_hashes"]["image"][0] = mm_hash
    return features


def file_in_root(server: Server, name: str, data: bytes) -> tuple[str, str]:
    path = server.store.root / name
    path.write_bytes(data)
    return f"file://{path}", hashlib.sha256(data).hexdigest()[:32]


def junk_file(server: Server, ids: list[int], feats: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    uri, mm_hash = file_in_root(server, "junk.png", b"\x89PNG\r\n\x1a\n this is not an image")
    return ids, with_ref(feats, raw_image_uri=uri, mm_hash=mm_hash)


def outside_root(server: Server, ids: list[int], feats: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    outside = server.store.root.parent / "outside.png"
    picture(9).save(outside)
    return ids, with_ref(feats, raw_image_uri=f"file://{outside}")


def a_directory(server: Server, ids: list[int], feats: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    (server.store.root / "a-directory").mkdir(exist_ok=True)
    return ids, with_ref(feats, raw_image_uri=f"file://{server.store.root}/a-directory")


def too_large(server: Server, ids: list[int], feats: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    return server.render([user(picture(11, 600, 500), "big")])  # 300k pixels, over the server's limit


def one_placeholder_short(
    server: Server, ids: list[int], feats: dict[str, Any]
) -> tuple[list[int], dict[str, Any]]:
    span = feats["mm_placeholders"]["image"][0]
    del ids[span["offset"]]
    span["length"] -= 1
    return ids, feats


def under_another_modality(
    server: Server, ids: list[int], feats: dict[str, Any]
) -> tuple[list[int], dict[str, Any]]:
    return ids, {key: {"vision_chunk": value["image"]} for key, value in feats.items()}


BAD_REFS: dict[str, Mutation] = {
    "malformed_ref": lambda s, ids, f: (ids, {**f, "kwargs_data": {"image": ["mmraw:{not json"]}}),
    "unknown_family": lambda s, ids, f: (ids, with_ref(f, family="llava")),
    "modality_mismatch": under_another_modality,
    "hash_mismatch": lambda s, ids, f: (ids, {**f, "mm_hashes": {"image": ["0" * 32]}}),
    "outside_offload_root": outside_root,
    "missing_file": lambda s, ids, f: (
        ids,
        with_ref(f, raw_image_uri=f"file://{s.store.root}/00/missing.png"),
    ),
    "unreadable_file": a_directory,
    "decode_error": junk_file,
    "image_too_large": too_large,
    "fingerprint_mismatch": lambda s, ids, f: (
        ids,
        with_ref(f, fingerprint=get_family("qwen_vl").fingerprint(s.config, "torchvision")),
    ),
    "grid_mismatch": lambda s, ids, f: (ids, with_ref(f, payload={"image_grid_thw": [[1, 2, 2]]})),
    "placeholder_mismatch": one_placeholder_short,
    "count_mismatch": lambda s, ids, f: (ids, {**f, "mm_hashes": {"image": f["mm_hashes"]["image"] * 2}}),
}


def test_every_reason_is_covered() -> None:
    from rawmm.contract import REASONS

    assert set(BAD_REFS) == set(REASONS)


@pytest.mark.parametrize("reason", sorted(BAD_REFS))
def test_each_bad_ref_is_a_400_with_its_reason_and_is_counted(server: Server, reason: str) -> None:
    token_ids, features = server.render([user(picture(50), "describe")])
    token_ids, features = BAD_REFS[reason](server, token_ids, features)
    before = server.metric("rawmm_invalid_mm_image_ref_total", reason=reason)
    response = generate(server, token_ids, features)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["reason"]) == ("invalid_mm_image_ref", reason), error
    assert error["message"]
    assert server.metric("rawmm_invalid_mm_image_ref_total", reason=reason) - before == 1


def test_impossible_prompts_are_400_invalid_request(server: Server) -> None:
    for body in (
        {"prompt_token_ids": [1, 10**9]},
        {"prompt_token_ids": [1] * 5000},
        {"prompt_token_ids": [1], "sampling": {"temperature": -1}},
        {"prompt_token_ids": [1], "unknown": 1},
        b"{not json",
    ):
        response = server.post("/v1/rawmm/generate", body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["type"] == "invalid_request"


# --- fuzzing: nothing a client sends is a 500 --------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
# Token budgets that are either tiny or far too large, so a fuzzed body never runs a long generation.
max_tokens = st.one_of(st.integers(max_value=3), st.integers(min_value=5000), json_values)


def mutate(value: Any, data: st.DataObject) -> Any:
    """``value`` with one randomly chosen leaf (or subtree) replaced by arbitrary JSON."""
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate(value[key], data)}
    if isinstance(value, list) and value and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(value) - 1))
        return [*value[:index], mutate(value[index], data), *value[index + 1 :]]
    return data.draw(json_values)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_fuzzed_body_is_never_a_server_error(server: Server, data: st.DataObject) -> None:
    token_ids, features = fuzz_base(server)
    kind = data.draw(st.sampled_from(["anything", "mutated features", "mutated body", "bytes"]))
    if kind == "anything":
        body: Any = data.draw(json_values)
    elif kind == "bytes":
        body = data.draw(st.binary(max_size=64))
    else:
        body = {
            "prompt_token_ids": token_ids,
            "features": mutate(features, data) if kind == "mutated features" else features,
            "sampling": data.draw(
                st.fixed_dictionaries({}, optional={"max_tokens": max_tokens, "seed": json_values})
            ),
        }
        if kind == "mutated body":
            body = mutate(body, data)
            if isinstance(body, dict) and isinstance(body.get("sampling"), dict):
                body["sampling"]["max_tokens"] = data.draw(max_tokens)
    response = server.post("/v1/rawmm/generate", body)
    assert response.status_code in (200, 400), (body, response.text)


_fuzz_base: dict[str, tuple[list[int], dict[str, Any]]] = {}


def fuzz_base(server: Server) -> tuple[list[int], dict[str, Any]]:
    if server.url not in _fuzz_base:
        _fuzz_base[server.url] = server.render([user(picture(70), "fuzz", picture(71, 40, 60))])
    token_ids, features = _fuzz_base[server.url]
    return list(token_ids), json.loads(json.dumps(features))


# --- weights ------------------------------------------------------------------------------------------------


def test_weight_updates_advance_the_version_and_each_response_reports_its_weights(
    server: Server, tmp_path: Path
) -> None:
    from rawmm.tiny import build_tiny_model

    other = build_tiny_model("qwen2_vl", tmp_path / "seed1", seed=1)
    token_ids, features = server.render([user(picture(80), "again")])
    version = httpx.get(f"{server.url}/health").json()["weights_version"]

    def sample() -> dict[str, Any]:
        response = generate(server, token_ids, features, seed=11, max_tokens=24)
        assert response.status_code == 200, response.text
        return response.json()

    before = sample()
    with ThreadPoolExecutor(4) as pool:
        during = [pool.submit(sample) for _ in range(3)]
        update = server.post("/v1/rawmm/weights", {"path": str(other)})
        results = [future.result() for future in during]
    assert update.status_code == 200, update.text
    assert update.json() == {"weights_version": version + 1}
    after = sample()
    assert after["weights_version"] == version + 1 and before["weights_version"] == version
    assert after["logprobs"] != before["logprobs"]  # other weights, other distribution
    for result in results:  # whichever side of the update a request fell on, it says so truthfully
        assert result == (before if result["weights_version"] == version else after)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "weights_version": version + 1}
    assert server.metric("rawmm_engine_weights_version") == version + 1

    missing = server.post("/v1/rawmm/weights", {"path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request"
    assert httpx.get(f"{server.url}/health").json()["weights_version"] == version + 1
