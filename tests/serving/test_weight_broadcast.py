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
from contextlib import closing, contextmanager
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

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 3}
RACE_TOKENS = 256
BUCKET_BYTES = 64 * 1024  # small: the stream is cut in many places, tensors split across none of them


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


@contextmanager
def broadcasting(
    model: Any, *servers: Server, bucket_bytes: int = BUCKET_BYTES, **init: Any
) -> Iterator[BroadcastSender]:
    """The trainer's side of a broadcast of ``model`` to ``servers`` (``init``: more of ``trainer_init``'s
    arguments), shut down and its client closed after."""
    with closing(HttpWeightSyncClient([server.url for server in servers])) as client:
        sender = BroadcastSender.trainer_init(
            model, client, master_address="127.0.0.1", bucket_bytes=bucket_bytes, **init
        )
        try:
            yield sender
        finally:
            sender.shutdown()


@pytest.fixture
def weights_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's client sends the replicas' weights token ($RAWMM_WEIGHTS_TOKEN)."""
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)


@pytest.fixture(scope="module")
def replicas(tiny_qwen2_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    args = ["--engine", "transformers", "--materialize-cache-size", "0"]
    with (
        running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("replica_a"), args) as a,
        running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("replica_b"), args) as b,
    ):
        yield [a, b]


@pytest.mark.usefixtures("weights_token")
def test_broadcast_weights_generate_what_the_checkpoint_of_them_does(
    replicas: list[Server], tiny_qwen2_vl: Path
) -> None:
    a, b = replicas
    before = generate(a)
    long_before = generate(b, max_tokens=RACE_TOKENS)
    model = trained(tiny_qwen2_vl, seed=1)
    with broadcasting(model, a, b) as sender:
        racing: dict[str, Any] = {}
        race = threading.Thread(target=lambda: racing.update(generate(a, max_tokens=RACE_TOKENS)))
        race.start()
        time.sleep(0.5)  # it is decoding (for seconds) when the update starts
        report = sender.send_weights("1")
        race.join()
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


@pytest.mark.usefixtures("weights_token")
def test_a_bf16_replica_gets_bf16_on_the_wire_and_beside_a_float32_one_float32(
    replicas: list[Server], tiny_qwen2_vl: Path, tmp_path: Path
) -> None:
    """Floating tensors travel in the replicas' served dtype when it is narrower: half the bytes to a bf16
    replica, and float32 when a float32 replica shares the group (cast on load by the bf16 one); both ways
    the bf16 replica serves what a reload of the float32 checkpoint gives it, bit for bit."""
    a, _ = replicas
    args = ["--engine", "transformers", "--materialize-cache-size", "0", "--dtype", "bfloat16"]
    with running_server(tiny_qwen2_vl, tmp_path, args) as bf16:
        floats = sum(p.numel() for p in trained(tiny_qwen2_vl, seed=0).parameters())
        cases = ((4, (a, bf16), ("float32", "bfloat16"), 4), (5, (bf16,), ("bfloat16",), 2))
        for seed, servers, served, itemsize in cases:
            model = trained(tiny_qwen2_vl, seed=seed)
            with broadcasting(model, *servers) as sender:
                report = sender.send_weights(str(seed))
            assert sender.served_dtypes == served
            assert report is not None and report.bytes_sent == floats * itemsize
            broadcast = generate(bf16)
            checkpoint = bf16.weights_root / f"step_{seed}"
            model.save_pretrained(checkpoint, safe_serialization=True)  # float32, as the trainer writes it
            assert bf16.load_weights(checkpoint).status_code == 200
            reloaded = generate(bf16)
            assert (reloaded["token_ids"], reloaded["logprobs"]) == (
                broadcast["token_ids"],
                broadcast["logprobs"],
            )
            assert reloaded["weights_version"] == broadcast["weights_version"] + 1


def test_the_transfer_routes_need_the_weights_token(replicas: list[Server]) -> None:
    a, _ = replicas
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path, body in ((INIT_PATH, init), (START_PATH, None)):
            response = httpx.post(f"{a.url}{path}", json=body, headers=headers, timeout=30.0)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["type"] == "weights_refused"


@pytest.mark.usefixtures("weights_token")
def test_a_model_that_does_not_fit_is_refused_and_the_old_weights_stay(
    replicas: list[Server], tiny_qwen3_vl: Path
) -> None:
    a, _ = replicas
    before = generate(a)
    other = trained(tiny_qwen3_vl, seed=2)
    with broadcasting(other, a) as sender, pytest.raises(WeightSyncFailed, match="weights_do_not_fit"):
        sender.send_weights("2")
    after = generate(a)
    assert after == before  # same version, same weights


@pytest.mark.usefixtures("weights_token")
def test_two_fsdp_ranks_broadcast_what_their_checkpoint_holds(
    replicas: list[Server], tiny_qwen2_vl: Path
) -> None:
    """2 trainer ranks (FSDP2, their shards gathered bucket by bucket) to 2 replicas."""
    a, b = replicas
    before = generate(a)
    checkpoint = b.weights_root / "fsdp"
    script = Path(__file__).with_name("broadcast_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(script), str(tiny_qwen2_vl), str(checkpoint), a.url, b.url]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bytes_sent"] == sum(p.numel() * 4 for p in trained(tiny_qwen2_vl, 0).parameters())
    assert set(report["versions"]) == {a.url, b.url}
    broadcast = generate(a)
    assert broadcast["weights_version"] == report["versions"][a.url]
    assert (broadcast["token_ids"], broadcast["logprobs"]) != (before["token_ids"], before["logprobs"])
    on_b = generate(b)
    assert (on_b["token_ids"], on_b["logprobs"]) == (broadcast["token_ids"], broadcast["logprobs"])
    assert b.load_weights(checkpoint).status_code == 200
    reloaded = generate(b)
    assert (reloaded["token_ids"], reloaded["logprobs"]) == (broadcast["token_ids"], broadcast["logprobs"])


def test_a_refused_init_fails_the_sender_at_once(replicas: list[Server], tiny_qwen2_vl: Path) -> None:
    a, _ = replicas  # no token in this process: the replica refuses the init
    model = trained(tiny_qwen2_vl, seed=3)
    started = time.monotonic()
    with pytest.raises(WeightSyncFailed, match="missing_token"), broadcasting(model, a, timeout_s=120):
        pass
    assert time.monotonic() - started < 60
