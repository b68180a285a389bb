"""Multi-turn rollouts on the real vLLM engine: raw refs vs vLLM's own image path, on one server.

R rollouts x T turns; each turn adds one new 1280x720 screenshot and resends every earlier image. Every
turn goes both ways, interleaved (the order alternates per turn), on the same `rawmm serve --engine vllm`:
  raw     POST /v1/rawmm/generate: token ids + raw refs into the offload store (our materialize path)
  native  POST /v1/chat/completions: the same PNG bytes as base64 data URLs (vLLM's processor path)
Greedy outputs must be identical. Reported per path: per-turn latency p50/p95, the API-server process's
CPU seconds (user + sys, measured around each request; requests run one at a time), request bytes; the
raw/native ratios; and the bytes of image items the raw path handed to the engine core. The model is a tiny random-weight Qwen2-VL with the real Qwen2-VL pixel budget
(a 1280x720 screenshot is 1196 placeholder tokens), so the image work is real and the LM is cheap.

    .venv/bin/python bench/vllm_multiturn.py [--rollouts 8] [--turns 10] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from screens import screenshot_image

from rawmm.contract import OffloadStore, get_family, render_chat

BACKEND = "torchvision"  # vLLM's own Qwen-VL processor backend, so both paths see the same pixels
WEIGHTS_TOKEN = "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def vllm_server(
    model: Path, work: Path, max_model_len: int, *, cache_size: str = "4Gi", max_num_seqs: int = 2
) -> Iterator[tuple[str, psutil.Process]]:
    """``rawmm serve --engine vllm`` on 127.0.0.1 (its own process group, stopped on exit): URL and process."""
    store_root = work / "offload"
    store_root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TMPDIR": str(work),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # the tiny model declares 4096 positions; RoPE extrapolates
        "RAWMM_WEIGHTS_TOKEN": WEIGHTS_TOKEN,
    }
    command = [
        sys.executable, "-m", "rawmm.cli", "serve", "--engine", "vllm", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--offload-root", str(store_root),
        "--processor-backend", BACKEND, "--materialize-cache-size", cache_size,
        "--", "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", "float32",
        "--max-num-seqs", str(max_num_seqs), "--limit-mm-per-prompt", '{"video": 0}',
    ]  # fmt: skip
    log = open(work / "serve.log", "wb")  # noqa: SIM115 (closed in finally)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited:\n{(work / 'serve.log').read_text()[-3000:]}")
            with suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.5)
        yield url, psutil.Process(process.pid)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


@dataclass
class PathStats:
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    request_bytes: int = 0

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def timed_post(
    http: httpx.Client, url: str, body: bytes, server: psutil.Process, stats: PathStats
) -> dict[str, Any]:
    cpu, started = cpu_seconds(server), time.perf_counter()
    response = http.post(url, content=body, headers={"Content-Type": "application/json"})
    stats.latencies.append(time.perf_counter() - started)
    stats.cpu_s += cpu_seconds(server) - cpu
    stats.request_bytes += len(body)
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rawmm.contract import resolve_preset
    from rawmm.run.tiny import build_tiny_model

    _, preset = resolve_preset("qwen2_vl")
    family = get_family("qwen_vl")
    with tempfile.TemporaryDirectory(prefix="rawmm-vllm-bench-") as tmp:
        work = Path(tmp)
        gpu_shape = os.environ.get("RAWMM_TINY_GPU_SHAPE") == "1"  # head_dim 128 (bench/gpu_check.sh)
        model = build_tiny_model(
            "qwen2_vl", work / "model", max_pixels=preset.max_pixels, gpu_shape=gpu_shape
        )
        config = family.config_from_pretrained(model)
        tokens_per_image = family.describe(width=1280, height=720, config=config).num_placeholder_tokens
        max_model_len = args.turns * (tokens_per_image + 64) + 256
        tokenizer = AutoTokenizer.from_pretrained(model)
        print(
            f"tiny Qwen2-VL, real pixel budget: a 1280x720 screenshot is {tokens_per_image} placeholder tokens; "
            f"{args.rollouts} rollouts x {args.turns} turns, max_model_len {max_model_len}"
        )
        started = time.monotonic()
        with vllm_server(model, work, max_model_len) as (url, server), httpx.Client(timeout=600) as http:
            print(f"server up in {time.monotonic() - started:.0f}s")
            store = OffloadStore(work / "offload")
            stats = {"raw": PathStats(), "native": PathStats()}
            per_turn: dict[str, list[list[float]]] = {
                "raw": [[] for _ in range(args.turns)],
                "native": [[] for _ in range(args.turns)],
            }
            mismatches = 0
            for rollout in range(args.rollouts):
                messages: list[dict[str, Any]] = []
                paths: dict[str, Path] = {}
                for turn in range(args.turns):
                    stored = store.put(screenshot_image(1000 * rollout + turn))
                    paths[stored.uri] = stored.path
                    messages.append(
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": stored.uri}},
                                {"type": "text", "text": f"step {turn}: click the next button"},
                            ],
                        }
                    )
                    rendered = render_chat(
                        messages,
                        tokenizer=tokenizer,
                        family=family,
                        config=config,
                        store=store,
                        backend=BACKEND,
                    )
                    raw_body = json.dumps(
                        {
                            "prompt_token_ids": rendered.token_ids,
                            "features": rendered.features(),
                            "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
                        }
                    ).encode()
                    native_messages = [
                        {
                            **m,
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {"url": data_url(paths[p["image_url"]["url"]])},
                                }
                                if p["type"] == "image_url"
                                else p
                                for p in m["content"]
                            ],
                        }
                        if isinstance(m["content"], list)
                        else m
                        for m in messages
                    ]
                    native_body = json.dumps(
                        {
                            "model": str(model),
                            "messages": native_messages,
                            "max_tokens": args.max_tokens,
                            "temperature": 0.0,
                            "logprobs": True,
                            "return_tokens_as_token_ids": True,
                        }
                    ).encode()
                    order = ("raw", "native") if (rollout + turn) % 2 == 0 else ("native", "raw")
                    outputs: dict[str, list[int]] = {}
                    for path in order:
                        before = len(stats[path].latencies)
                        if path == "raw":
                            body = timed_post(http, f"{url}/v1/rawmm/generate", raw_body, server, stats[path])
                            outputs[path] = body["token_ids"]
                        else:
                            body = timed_post(
                                http, f"{url}/v1/chat/completions", native_body, server, stats[path]
                            )
                            content = body["choices"][0]["logprobs"]["content"]
                            outputs[path] = [int(e["token"].removeprefix("token_id:")) for e in content]
                        per_turn[path][turn].append(stats[path].latencies[before])
                    if outputs["raw"] != outputs["native"]:
                        mismatches += 1
                    messages.append(
                        {
                            "role": "assistant",
                            "content": tokenizer.decode(outputs["raw"], skip_special_tokens=True),
                        }
                    )
                print(f"rollout {rollout + 1}/{args.rollouts} done ({time.monotonic() - started:.0f}s)")
            metrics_text = http.get(f"{url}/metrics").text
        engine_core_bytes = sum(
            sample.value
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples
            if sample.name == "rawmm_engine_core_item_bytes_total"
        )
        requests = args.rollouts * args.turns
        print(f"\n{requests} turns each way; outputs identical: {requests - mismatches}/{requests}")
        print(f"{'path':8} {'p50 s':>8} {'p95 s':>8} {'API CPU s':>10} {'MiB sent':>10}")
        for path, s in stats.items():
            print(
                f"{path:8} {s.p(0.5):8.3f} {s.p(0.95):8.3f} {s.cpu_s:10.2f} {s.request_bytes / 2**20:10.2f}"
            )
        raw, native = stats["raw"], stats["native"]
        print(
            f"ratios raw/native: p50 {raw.p(0.5) / native.p(0.5):.2f}x, p95 {raw.p(0.95) / native.p(0.95):.2f}x, "
            f"API-server CPU {raw.cpu_s / native.cpu_s:.2f}x, request bytes {raw.request_bytes / native.request_bytes:.4f}x"
        )
        print(
            f"raw path: {engine_core_bytes / 2**20:.1f} MiB of image items crossed to the engine core "
            f"({engine_core_bytes / 2**20 / requests:.2f} MiB per request)"
        )
        print("per-turn p50 latency (s), raw | native:")
        for turn in range(args.turns):
            print(
                f"  turn {turn + 1:2d}: {statistics.median(per_turn['raw'][turn]):.3f} | "
                f"{statistics.median(per_turn['native'][turn]):.3f}"
            )
        if mismatches:
            raise SystemExit(f"{mismatches} turns differ between raw refs and vLLM's own path")


if __name__ == "__main__":
    main()
