"""Trainer → engine weight sync: today's checkpoint reload against the gloo broadcast (issue 31).

For 1 and 2 `rawmm serve --engine transformers` replicas of a widened tiny Qwen2-VL (random float32
weights; `--layers`/`--hidden` set its size; `--dtype bfloat16` serves them in bf16, so the broadcast
sends bf16 while the trainer keeps float32), per update:
- checkpoint: the trainer writes the weights as safetensors (`save_pretrained`, what `save_checkpoint`
  does for the weights), then every replica loads them (`POST /v1/rawmm/weights`, concurrently);
- broadcast: `BroadcastSender.send_weights` (start → update + broadcast → finish) over loopback gloo.
Per update: seconds until every replica serves the new weights, the engine pause as a client sees it (the
longest 1-token generation on replica 0 while the update runs, a probe polling back to back), and the
bytes moved (written + read per replica for the checkpoint, sent per replica for the broadcast).

    .venv/bin/python bench/weight_sync.py [--layers 16 --hidden 1024 --updates 3 --dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch

TOKEN = "bench-weights-token"
PROMPT = [5, 9, 13, 17]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def widened_model(out: Path, layers: int, hidden: int) -> Path:
    """The tiny Qwen2-VL (tokenizer, processor) with a wider, deeper text model of random weights."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rawmm.run.tiny import build_tiny_model

    tiny = build_tiny_model("qwen2_vl", out / "tiny", seed=0)
    config = AutoConfig.from_pretrained(tiny)
    text = config.text_config
    heads = hidden // 64
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, hidden * 11 // 4, layers
    text.num_attention_heads, text.num_key_value_heads = heads, max(1, heads // 4)
    text.layer_types = ["full_attention"] * layers
    text.rope_parameters["mrope_section"] = [8, 12, 12]  # head dim 64
    config.vision_config.hidden_size = hidden  # the merger projects into the text width
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    wide = out / "wide"
    model.save_pretrained(wide, safe_serialization=True)
    for f in tiny.iterdir():
        if (
            f.is_file()
            and not f.name.endswith((".safetensors", "config.json"))
            or f.name.endswith(("tokenizer_config.json", "preprocessor_config.json", "processor_config.json"))
        ):
            shutil.copy2(f, wide / f.name)
    return wide


@contextlib.contextmanager
def replica(model: Path, work: Path, dtype: str) -> Iterator[str]:
    (work / "offload").mkdir(parents=True)
    port = free_port()
    command = [sys.executable, "-m", "rawmm.cli", "serve", "--engine", "transformers", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--offload-root", str(work / "offload"),
               "--weights-root", str(work.parent), "--materialize-cache-size", "0", "--dtype", dtype]  # fmt: skip
    with open(work / "serve.log", "wb") as log:
        process = subprocess.Popen(
            command, env={**os.environ, "RAWMM_WEIGHTS_TOKEN": TOKEN}, stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                tail = (work / "serve.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the replica exited:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def one_token(url: str) -> None:
    body = {"prompt_token_ids": PROMPT, "sampling": {"max_tokens": 1, "temperature": 0.0}}
    httpx.post(f"{url}/v1/rawmm/generate", json=body, timeout=600).raise_for_status()


def probed(url: str, update: Callable[[], Any]) -> tuple[float, float, Any]:
    """Run `update` while a probe sends 1-token generations to `url` back to back; returns the update's
    seconds, the longest probe latency that overlapped it, and its result."""
    latencies: list[tuple[float, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            one_token(url)
            latencies.append((t0, time.perf_counter()))

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.3)
    started = time.perf_counter()
    result = update()
    ended = time.perf_counter()
    stop.set()
    thread.join()
    overlapping = [b - a for a, b in latencies if b > started and a < ended]
    return ended - started, max(overlapping, default=0.0), result


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * step)


def bench(
    model_dir: Path, work: Path, replicas: int, updates: int, bucket_bytes: int, dtype: str
) -> dict[str, Any]:
    from transformers import AutoModelForImageTextToText

    from rawmm.rl.trainer.weight_broadcast import BroadcastSender
    from rawmm.rl.trainer.weight_sync_client import HttpWeightSyncClient

    os.environ["RAWMM_WEIGHTS_TOKEN"] = TOKEN
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(replica(model_dir, work / f"r{replicas}_{i}", dtype)) for i in range(replicas)
        ]
        baseline = probed(urls[0], lambda: time.sleep(2))[1]  # the probe's own latency, nothing running
        rows: dict[str, list[dict[str, float]]] = {"checkpoint": [], "broadcast": []}
        for step in range(1, updates + 1):
            perturb(model, step)
            path = work / f"ckpt_{replicas}_{step}"

            def by_checkpoint(path: Path = path) -> tuple[float, int]:
                t0 = time.perf_counter()
                model.save_pretrained(path, safe_serialization=True)
                written = time.perf_counter() - t0
                with httpx.Client(timeout=600) as http, ThreadPoolExecutor(len(urls)) as pool:
                    load = {"path": str(path)}
                    auth = {"Authorization": f"Bearer {TOKEN}"}
                    answers = pool.map(
                        lambda u: http.post(f"{u}/v1/rawmm/weights", json=load, headers=auth), urls
                    )
                    for answer in answers:
                        answer.raise_for_status()
                size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                return written, size

            seconds, pause, (written, size) = probed(urls[0], by_checkpoint)
            rows["checkpoint"].append(
                {
                    "seconds": seconds,
                    "pause": pause,
                    "write_seconds": written,
                    "bytes": size * (1 + replicas),
                }  # fmt: skip
            )
            shutil.rmtree(path)

        client = HttpWeightSyncClient(urls)
        sender = BroadcastSender.trainer_init(
            model, client, master_address="127.0.0.1", bucket_bytes=bucket_bytes
        )
        try:
            for step in range(1, updates + 1):
                perturb(model, step)
                seconds, pause, report = probed(urls[0], partial(sender.send_weights, str(step)))
                rows["broadcast"].append(
                    {
                        "seconds": seconds,
                        "pause": pause,
                        "write_seconds": 0.0,
                        "bytes": report.bytes_sent * replicas,
                        "broadcast_seconds": report.broadcast_seconds,
                    }  # fmt: skip
                )
        finally:
            sender.shutdown()
            client.close()
    return {
        "replicas": replicas,
        "probe_baseline_s": baseline,
        **{kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in rows.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the replicas'")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rawmm-weight-sync-") as tmp:
        work = Path(tmp)
        model_dir = widened_model(work, args.layers, args.hidden)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(
            f"model: Qwen2-VL text {args.layers} layers x {args.hidden}, {size / 2**20:.0f} MiB float32, "
            f"served in {args.dtype}",
            flush=True,
        )
        results = []
        for n in args.replicas:
            result = bench(model_dir, work, n, args.updates, args.bucket_mib * 2**20, args.dtype)
            print(json.dumps(result), flush=True)
            results.append(result)
        print("\n| replicas | path | update s | pause s (probe) | write s | bytes moved |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            for kind in ("checkpoint", "broadcast"):
                row = r[kind]
                print(f"| {r['replicas']} | {kind} | {row['seconds']:.2f} | {row['pause']:.2f} | "
                      f"{row['write_seconds']:.2f} | {row['bytes'] / 2**20:.0f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
