"""A real `rawmm serve` process on 127.0.0.1 for HTTP tests: start, wait for /health, always stop.

`serve_process` is the one way tests start a server (this module's transformers engine and
`vllm_harness`'s vLLM engine): its own process group, torn down whole whatever happens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from rawmm.contract import OffloadStore, get_family, render_chat

WEIGHTS_TOKEN = "test-weights-token"  # every test server's $RAWMM_WEIGHTS_TOKEN
MAX_IMAGE_PIXELS = 250_000  # the transformers test server's decompression-bomb limit (conftest's `server`)


@dataclass
class Server:
    url: str
    store: OffloadStore
    tokenizer: Any
    config: Any
    log: Path
    weights_root: Path
    pid: int  # the server's process (the leader of its group)

    def post(self, route: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}{route}", content=content, headers=headers, timeout=120.0)

    def load_weights(self, path: Path | str, token: str = WEIGHTS_TOKEN) -> httpx.Response:
        return self.post("/v1/rawmm/weights", {"path": str(path)}, {"Authorization": f"Bearer {token}"})

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30.0).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    def render(self, messages: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
        rendered = render_chat(
            messages,
            tokenizer=self.tokenizer,
            family=get_family("qwen_vl"),
            config=self.config,
            store=self.store,
        )
        return rendered.token_ids, rendered.features()


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rawmm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"rawmm serve did not answer /health within {timeout_s}s:\n{log.read_text()[-3000:]}")


@contextmanager
def serve_process(
    command: Sequence[str], env: dict[str, str], log: Path, url: str, timeout_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a process group of its own, logging to ``log``; yields once ``url`` answers /health and
    stops the whole group on exit (a vLLM server's engine core included)."""
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_healthy(url, process, log, timeout_s)
        yield process
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 30 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left (an engine core)
    process.wait(timeout=30)


@contextmanager
def running_server(
    model: Path, work: Path, serve_args: Sequence[str], *, timeout_s: float = 240.0, port: int | None = None
) -> Iterator[Server]:
    """``rawmm serve --model model`` with an offload store under ``work``; terminated on exit, whatever happens.
    ``port``: a replica restarted at the address it had (a free one by default).

    Weight updates are open to ``WEIGHTS_TOKEN`` from ``work/checkpoints`` (``Server.weights_root``)."""
    from transformers import AutoTokenizer

    store = OffloadStore(work / "offload")
    weights_root = work / "checkpoints"
    weights_root.mkdir(exist_ok=True)
    port = port or free_port()
    log = work / "serve.log"
    command = [
        sys.executable, "-m", "rawmm.cli", "serve", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--offload-root", str(store.root),
        "--weights-root", str(weights_root), *serve_args,
    ]  # fmt: skip
    env = {**os.environ, "RAWMM_WEIGHTS_TOKEN": WEIGHTS_TOKEN}
    url = f"http://127.0.0.1:{port}"
    with serve_process(command, env, log, url, timeout_s) as process:
        yield Server(
            url=url,
            store=store,
            tokenizer=AutoTokenizer.from_pretrained(model),
            config=get_family("qwen_vl").config_from_pretrained(model),
            log=log,
            weights_root=weights_root,
            pid=process.pid,
        )


@contextmanager
def request_in_flight(url: str, route: str, body: Any) -> Iterator[None]:
    """A POST of ``body`` on a connection of its own whose response is never read: leaving the block hangs up,
    as a client that timed out or gave up does."""
    address = httpx.URL(url)
    content = json.dumps(body).encode()
    head = f"POST {route} HTTP/1.1\r\nHost: {address.host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((address.host, address.port or 80), timeout=30.0) as sock:
        sock.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n".encode() + content)
        yield


def poll(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def picture(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def user(*parts: Any) -> dict[str, Any]:
    content = [
        {"type": "image", "image": p} if isinstance(p, Image.Image) else {"type": "text", "text": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


def generate(server: Server, token_ids: list[int], features: Any, **sampling: Any) -> httpx.Response:
    body = {"prompt_token_ids": token_ids, "features": features, "sampling": {"max_tokens": 6, **sampling}}
    return server.post("/v1/rawmm/generate", body)
