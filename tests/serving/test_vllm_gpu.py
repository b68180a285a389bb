"""`rawmm serve --engine vllm` end to end on a CUDA GPU (deselected by default: ``-m gpu`` runs it).

Needs the full vLLM 0.33 install (``pip install -c constraints.txt 'rawmm[inference]'``) and a GPU. The model
is the tiny Qwen2-VL checkpoint unless ``RAWMM_GPU_TEST_MODEL`` names a local Qwen-VL checkpoint directory:

    RAWMM_GPU_TEST_MODEL=/models/Qwen2-VL-2B-Instruct .venv/bin/python -m pytest -m gpu tests/serving/test_vllm_gpu.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_harness import Server, generate, picture, running_server, user

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_model(tiny_qwen2_vl: Path) -> Path:
    return Path(os.environ.get("RAWMM_GPU_TEST_MODEL", tiny_qwen2_vl))


@pytest.fixture(scope="module")
def vllm_server(gpu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("vllm.v1.engine.async_llm")
    serve_args = ["--engine", "vllm", "--materialize-cache-size", "1Gi", "--",
                  "--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--enforce-eager"]  # fmt: skip
    with running_server(gpu_model, tmp_path_factory.mktemp("vllm"), serve_args, timeout_s=900) as server:
        yield server


def test_multi_turn_generation_through_vllm_hits_the_cache(vllm_server: Server) -> None:
    server = vllm_server
    hits, misses = (server.metric(f"rawmm_materialize_cache_{k}_total") for k in ("hits", "misses"))
    messages = []
    for turn in range(3):
        messages.append(user(picture(200 + turn), picture(300 + turn, 80, 40), f"turn {turn}"))
        token_ids, features = server.render(messages)
        response = generate(server, token_ids, features, seed=turn, max_tokens=8)
        assert response.status_code == 200, response.text
        out = response.json()
        assert 1 <= len(out["token_ids"]) <= 8 and len(out["logprobs"]) == len(out["token_ids"])
        assert all(lp <= 0 for lp in out["logprobs"])
        reply = server.tokenizer.decode(out["token_ids"], skip_special_tokens=True)  # no stray image markers
        messages.append({"role": "assistant", "content": reply})
    assert server.metric("rawmm_materialize_cache_misses_total") - misses == 6
    assert server.metric("rawmm_materialize_cache_hits_total") - hits == 2 + 4


def test_seeded_sampling_is_reproducible_and_pixels_matter(vllm_server: Server) -> None:
    token_ids, features = vllm_server.render([user(picture(1), "describe")])
    first = generate(vllm_server, token_ids, features, seed=3).json()
    assert generate(vllm_server, token_ids, features, seed=3).json() == first
    other_ids, other_features = vllm_server.render([user(picture(2), "describe")])
    greedy = [
        generate(vllm_server, ids, feats, temperature=0.0, max_tokens=1).json()["logprobs"]
        for ids, feats in ((token_ids, features), (other_ids, other_features))
    ]
    assert greedy[0] != greedy[1]


def test_a_bad_ref_is_a_400_on_vllm_too(vllm_server: Server) -> None:
    token_ids, features = vllm_server.render([user(picture(5), "describe")])
    features["mm_hashes"]["image"][0] = "0" * 32
    response = generate(vllm_server, token_ids, features)
    assert response.status_code == 400
    assert response.json()["error"]["reason"] == "hash_mismatch"


def test_weights_reload_in_place_and_the_version_advances(vllm_server: Server, gpu_model: Path) -> None:
    token_ids, features = vllm_server.render([user(picture(6), "again")])
    before = generate(vllm_server, token_ids, features, temperature=0.0).json()
    response = vllm_server.post("/v1/rawmm/weights", {"path": str(gpu_model)})
    assert response.status_code == 200, response.text
    assert response.json() == {"weights_version": before["weights_version"] + 1}
    health = httpx.get(f"{vllm_server.url}/health").json()
    assert health == {"status": "ok", "weights_version": before["weights_version"] + 1}
    after = generate(vllm_server, token_ids, features, temperature=0.0).json()
    # The same weights reloaded: the same greedy completion, now reported under the new version.
    assert after["token_ids"] == before["token_ids"]
    assert after["weights_version"] == before["weights_version"] + 1
