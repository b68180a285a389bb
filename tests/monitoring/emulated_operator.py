"""The real `rawmm operator` process, with the Kubernetes API emulator (kmock, the operator's test kit) as
its API server, served from a thread of the test process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from monitoring_helpers import stop_process, wait_until
from ports import free_port


class EmulatedOperator:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.metrics_port = free_port()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve_emulator, name="kube-emulator", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._process: subprocess.Popen[Any] | None = None
        self.url = ""

    def _serve_emulator(self) -> None:
        from kube.emulator import emulated_cluster

        async def main() -> None:
            async with emulated_cluster() as cluster:
                self.url = cluster.url
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), "the API emulator did not start"
        kubeconfig = self.workdir / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": "test"}}],
                    "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
                    "current-context": "emulator",
                }
            )
        )
        self._log = (self.workdir / "operator.log").open("w")
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rawmm.cli",
                "operator",
                "--all-namespaces",
                "--host",
                "127.0.0.1",
                f"--metrics-port={self.metrics_port}",
                f"--liveness-port={free_port()}",
                "--resync-seconds=1",
            ],  # fmt: skip
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "RAWMM_POD_MONITOR": "true"},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_serving_metrics(self, timeout: float = 60) -> None:
        import httpx

        def serving() -> bool:
            try:
                return (
                    httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).status_code == 200
                )
            except httpx.TransportError:
                return False

        wait_until(serving, "the operator's metrics endpoint", timeout, self._process)

    def create(self, manifest: dict[str, Any]) -> None:
        from kubernetes import client as k8s

        from rawmm_operator.kube import KubeApi

        with k8s.ApiClient(k8s.Configuration(host=self.url)) as api_client:
            KubeApi(api_client).create(manifest)

    def stop(self) -> None:
        if self._process is not None:
            stop_process(self._process)
            self._log.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
