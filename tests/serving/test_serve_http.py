"""`rawmm serve --engine transformers` as a real process on 127.0.0.1, serving the tiny Qwen2-VL checkpoint.

One server for the session (``server`` in conftest, shared with the fuzz tests: start-up is the expensive
part); every test reads counter deltas, never absolute values, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from serve_harness import WEIGHTS_TOKEN, Server, generate, picture, user

from rawmm.contract import RawImageDescriptor, encode_ref, get_family, parse_ref
from rawmm.contract.families import Backend

pytestmark = pytest.mark.slow


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


# --- every way a ref can be bad (docs/architecture.md §3.5) -----------------------------------------------

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


def other_backends_fingerprint(server: Server) -> str:
    """The processor fingerprint of the backend the server does not run (it runs the family's default)."""
    family = get_family("qwen_vl")
    other = next(backend for backend in get_args(Backend) if backend != family.default_backend)
    return family.fingerprint(server.config, other)


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
    "fingerprint_mismatch": lambda s, ids, f: (ids, with_ref(f, fingerprint=other_backends_fingerprint(s))),
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


def test_impossible_prompts_and_bodies_are_4xx_invalid_request_with_a_reason(server: Server) -> None:
    for body, reason in (
        ({"prompt_token_ids": [1, 10**9]}, "token_out_of_vocabulary"),
        ({"prompt_token_ids": [1] * 5000}, "prompt_too_long"),
        ({"prompt_token_ids": [1], "sampling": {"temperature": -1}}, "invalid_body"),
        # vLLM's floor, for both engines; far below it, logits / temperature would overflow float32
        ({"prompt_token_ids": [1], "sampling": {"temperature": 0.001}}, "temperature_too_low"),
        ({"prompt_token_ids": [1], "sampling": {"temperature": 1e-39}}, "temperature_too_low"),
        ({"prompt_token_ids": [1], "unknown": 1}, "invalid_body"),
        (b"{not json", "invalid_json"),
        (b"[" * 20 + b"0" * (17 * 1024 * 1024), "body_too_large"),
    ):
        response = server.post("/v1/rawmm/generate", body)
        assert response.status_code == (413 if reason == "body_too_large" else 400), (body, response.text)
        error = response.json()["error"]
        assert (error["type"], error["reason"]) == ("invalid_request", reason) and error["message"]
    for response, status, reason in (
        (httpx.get(f"{server.url}/v1/nope"), 404, "not_found"),
        (httpx.get(f"{server.url}/v1/rawmm/generate"), 405, "method_not_allowed"),
    ):
        assert response.status_code == status
        assert response.json()["error"]["reason"] == reason


# --- weights ------------------------------------------------------------------------------------------------


def test_weight_updates_advance_the_version_and_each_response_reports_its_weights(
    server: Server, tmp_path: Path
) -> None:
    from rawmm.run.tiny import build_tiny_model

    other = build_tiny_model("qwen2_vl", server.weights_root / "seed1", seed=1)
    token_ids, features = server.render([user(picture(80), "again")])
    version = httpx.get(f"{server.url}/health").json()["weights_version"]

    def sample() -> dict[str, Any]:
        response = generate(server, token_ids, features, seed=11, max_tokens=24)
        assert response.status_code == 200, response.text
        return response.json()

    before = sample()
    with ThreadPoolExecutor(4) as pool:
        during = [pool.submit(sample) for _ in range(3)]
        update = server.load_weights(other)
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

    missing = server.load_weights(server.weights_root / "nope")
    assert missing.status_code == 400, missing.text
    assert missing.json()["error"] == {
        "type": "invalid_request",
        "reason": "not_a_checkpoint",
        "message": missing.json()["error"]["message"],
    }
    assert httpx.get(f"{server.url}/health").json()["weights_version"] == version + 1


def test_a_checkpoint_that_does_not_load_is_a_400_and_the_served_weights_stay(
    server: Server, tiny_qwen2_vl: Path
) -> None:
    import shutil

    version = httpx.get(f"{server.url}/health").json()["weights_version"]
    token_ids, features = server.render([user(picture(80), "again")])
    before = generate(server, token_ids, features, seed=3).json()
    breakages: dict[str, Callable[[Path], Any]] = {
        "random_header": lambda d: (d / "model.safetensors").write_bytes(b"\x07" * 100),
        "cut_file": lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:200]
        ),
        "null_config": lambda d: (d / "config.json").write_text("null"),
    }
    for name, breakage in breakages.items():
        broken = shutil.copytree(tiny_qwen2_vl, server.weights_root / name)
        breakage(broken)
        response = server.load_weights(broken)
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["reason"] == "unloadable_weights", (name, response.text)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "weights_version": version}
    assert generate(server, token_ids, features, seed=3).json() == before


def test_weight_updates_need_the_token_and_a_path_inside_the_weights_root(
    server: Server, tiny_qwen2_vl: Path
) -> None:
    # A real checkpoint, reachable only by escaping the root: by its own path, or by a symlink inside the root.
    escape = server.weights_root / "escape"
    escape.symlink_to(tiny_qwen2_vl, target_is_directory=True)
    reasons = ("missing_token", "invalid_token", "outside_weights_root")
    before = {reason: server.metric("rawmm_weights_refused_total", reason=reason) for reason in reasons}
    refused = [
        ("missing_token", server.post("/v1/rawmm/weights", {"path": str(tiny_qwen2_vl)})),
        ("invalid_token", server.load_weights(tiny_qwen2_vl, token="guess")),
        ("outside_weights_root", server.load_weights(tiny_qwen2_vl)),
        ("outside_weights_root", server.load_weights(escape)),
    ]
    for reason, response in refused:
        assert response.status_code == 403, response.text
        assert (response.json()["error"]["type"], response.json()["error"]["reason"]) == (
            "weights_refused",
            reason,
        )
    after = {reason: server.metric("rawmm_weights_refused_total", reason=reason) for reason in reasons}
    assert {reason: after[reason] - before[reason] for reason in reasons} == {
        "missing_token": 1,
        "invalid_token": 1,
        "outside_weights_root": 2,
    }
    for path in ("relative/dir", "/" + "a" * 300, f"{server.weights_root}/x\\u0000"):
        body = ('{"path": "' + path + '"}').encode()
        response = server.post("/v1/rawmm/weights", body, {"Authorization": f"Bearer {WEIGHTS_TOKEN}"})
        assert response.status_code == 400 and response.json()["error"]["reason"] == "malformed_path", path
