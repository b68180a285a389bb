"""Weights broadcast from a trainer into two transformers-engine replicas over gloo (vLLM's weight-transfer
protocol on CPU): the same outputs, bit for bit, as a reload of the same weights from a checkpoint; the
update waits for running generations and moves the version only at its end; the routes stay behind the
weights token; a replica whose model does not fit refuses the update without hanging the sender."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ports import free_port
from serve_harness import WEIGHTS_TOKEN, Server, running_server

from rawmm.contract.weight_transfer import INIT_PATH, START_PATH
from rawmm.rl.trainer.weight_broadcast import BroadcastSender
from rawmm.rl.trainer.weight_sync_client import HttpWeightSyncClient, WeightSyncFailed

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 3}
RACE_TOKENS = 256


def generate(server: Server, max_tokens: int = 12) -> dict[str, Any]:
    body = {"prompt_token_ids": PROMPT, "sampling": {**SAMPLING, "max_tokens": max_tokens}}
    response = httpx.post(f"{server.url}/v1/rawmm/generate", json=body, timeout=300.0)
    assert response.status_code == 200, response.text
    return dict(response.json())


def trained(model_dir: Path, seed: int) -> Any:
    """The checkpoint's model with every parameter moved, as a training step would."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def replicas(tiny_qwen2_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    args = ["--engine", "transformers", "--materialize-cache-size", "0"]
    with (
        running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("replica_a"), args) as a,
        running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("replica_b"), args) as b,
    ):
        yield [a, b]


@pytest.mark.slow
def test_broadcast_weights_generate_what_the_checkpoint_of_them_does(
    replicas: list[Server], tiny_qwen2_vl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    a, b = replicas
    before = generate(a)
    long_before = generate(b, max_tokens=RACE_TOKENS)
    model = trained(tiny_qwen2_vl, seed=1)
    client = HttpWeightSyncClient([a.url, b.url])
    # Small buckets: the stream is cut in many places, tensors split across none of them.
    sender = BroadcastSender.trainer_init(model, client, master_address="127.0.0.1", bucket_bytes=64 * 1024)
    try:
        racing: dict[str, Any] = {}
        race = threading.Thread(target=lambda: racing.update(generate(a, max_tokens=RACE_TOKENS)))
        race.start()
        time.sleep(0.5)  # it is decoding (for seconds) when the update starts
        report = sender.send_weights("1")
        race.join()
    finally:
        sender.shutdown()
        client.close()
    assert report is not None
    assert report.versions == {a.url: 1, b.url: 1}
    assert report.buckets > 5
    assert report.bytes_sent == sum(p.numel() * 4 for p in model.parameters())
    # The update waited for the running generation, which ran wholly on the old weights.
    assert racing["weights_version"] == 0
    assert racing["token_ids"] == long_before["token_ids"]
    assert racing["logprobs"] == long_before["logprobs"]

    broadcast = generate(a)
    assert broadcast["weights_version"] == 1
    assert (broadcast["token_ids"], broadcast["logprobs"]) != (before["token_ids"], before["logprobs"])
    assert generate(b) == broadcast

    checkpoint = b.weights_root / "step_1"
    model.save_pretrained(checkpoint, safe_serialization=True)
    assert b.load_weights(checkpoint).json()["weights_version"] == 2
    reloaded = generate(b)
    assert reloaded["token_ids"] == broadcast["token_ids"]
    assert reloaded["logprobs"] == broadcast["logprobs"]


@pytest.mark.slow
def test_the_transfer_routes_need_the_weights_token(replicas: list[Server]) -> None:
    a, _ = replicas
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path, body in ((INIT_PATH, init), (START_PATH, None)):
            response = httpx.post(f"{a.url}{path}", json=body, headers=headers, timeout=30.0)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["type"] == "weights_refused"


@pytest.mark.slow
def test_a_model_that_does_not_fit_is_refused_and_the_old_weights_stay(
    replicas: list[Server], tiny_qwen3_vl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    a, _ = replicas
    before = generate(a)
    other = trained(tiny_qwen3_vl, seed=2)
    client = HttpWeightSyncClient([a.url])
    sender = BroadcastSender.trainer_init(other, client, master_address="127.0.0.1", bucket_bytes=64 * 1024)
    try:
        with pytest.raises(WeightSyncFailed, match="weights_do_not_fit"):
            sender.send_weights("2")
    finally:
        sender.shutdown()
        client.close()
    after = generate(a)
    assert after == before  # same version, same weights


@pytest.mark.slow
def test_two_fsdp_ranks_broadcast_what_their_checkpoint_holds(
    replicas: list[Server], tiny_qwen2_vl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)
    a, b = replicas
    before = generate(a)
    checkpoint = b.weights_root / "fsdp"
    script = Path(__file__).with_name("broadcast_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(script), str(tiny_qwen2_vl), str(checkpoint), a.url]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bytes_sent"] == sum(p.numel() * 4 for p in trained(tiny_qwen2_vl, 0).parameters())
    broadcast = generate(a)
    assert broadcast["weights_version"] == report["versions"][a.url]
    assert (broadcast["token_ids"], broadcast["logprobs"]) != (before["token_ids"], before["logprobs"])
    assert b.load_weights(checkpoint).status_code == 200
    reloaded = generate(b)
    assert (reloaded["token_ids"], reloaded["logprobs"]) == (broadcast["token_ids"], broadcast["logprobs"])


@pytest.mark.slow
def test_a_refused_init_fails_the_sender_at_once(replicas: list[Server], tiny_qwen2_vl: Path) -> None:
    a, _ = replicas  # no token in this process: the replica refuses the init
    model = trained(tiny_qwen2_vl, seed=3)
    client = HttpWeightSyncClient([a.url])
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncFailed, match="missing_token"):
            BroadcastSender.trainer_init(model, client, master_address="127.0.0.1", timeout_s=120)
    finally:
        client.close()
    assert time.monotonic() - started < 60
