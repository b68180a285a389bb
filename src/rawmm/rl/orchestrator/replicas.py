"""The engine replicas of a run: which one serves a rollout, which are down, and bringing them back.

Pinning: every rollout goes to the live replica that ranks first for its key under rendezvous
(highest-random-weight) hashing, so all its turns hit the same replica's materialize cache, the
choice is stable across processes (no Python `hash()`), and a replica going down moves only its
own rollouts. A replica whose request fails after the client's retries, or that answers on older weights
than it was given (it restarted unseen), is marked down and the request moves to the next replica in the
rollout's ranking. While any replica is down a
background probe polls its `/health`; when it answers, it is told to load the latest weights
before it takes rollouts again (with the trainer broadcasting the weights, `catch_up` says which checkpoint,
and whether it is written yet). When no replica is up, requests wait up to `down_timeout_s` for
one to come back, then fail with `NoReplicaAvailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence

import httpx

from rawmm.contract.engine_api import GenerateRequest, GenerateResponse
from rawmm.rl.orchestrator.engine_client import EngineClient, EngineError, ReplicaUnavailable
from rawmm.rl.orchestrator.metrics import OrchestratorMetrics

log = logging.getLogger(__name__)


class NoReplicaAvailable(RuntimeError):
    """Every engine replica stayed down for longer than the pool's timeout."""


def rendezvous_order(key: str, urls: Sequence[str]) -> list[str]:
    """`urls` ranked for `key`, best first; the same for every process and every run."""

    def score(url: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()

    return sorted(urls, key=score, reverse=True)


class ReplicaPool:
    def __init__(
        self,
        urls: Sequence[str],
        client: EngineClient,
        metrics: OrchestratorMetrics,
        *,
        down_timeout_s: float = 300.0,
        probe_interval_s: float = 1.0,
    ) -> None:
        if not urls:
            raise ValueError("a replica pool needs at least one engine URL")
        self.urls = list(dict.fromkeys(urls))
        self._client, self._metrics = client, metrics
        self._down_timeout_s, self._probe_interval_s = down_timeout_s, probe_interval_s
        self._down: set[str] = set()
        self._any_up = asyncio.Event()
        self._any_up.set()
        self._probe: asyncio.Task[None] | None = None
        self._weights_path: str | None = None
        self.weights_versions: dict[str, int] = {}
        # Set when the trainer broadcasts the weights: (ready, checkpoint path or None for the base weights)
        # of what a revived replica loads; not ready keeps it down for now.
        self.catch_up: Callable[[], tuple[bool, str | None]] | None = None
        metrics.replicas_up.set(len(self.urls))

    @property
    def up(self) -> list[str]:
        return [url for url in self.urls if url not in self._down]

    async def wait_ready(self) -> None:
        """Wait for every replica to answer `/health` (engines may still be loading), at most
        `down_timeout_s`; then go on with those that are up, the others marked down. None up is
        `NoReplicaAvailable`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._down_timeout_s
        pending = set(self.urls)
        while True:
            for url in sorted(pending):
                try:
                    self.weights_versions[url] = await self._client.health(url)
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                pending.discard(url)
            if not pending or loop.time() >= deadline:
                break
            log.info("waiting for engine replicas to become healthy: %s", ", ".join(sorted(pending)))
            await asyncio.sleep(self._probe_interval_s)
        if len(pending) == len(self.urls):
            raise NoReplicaAvailable(
                f"no engine replica became healthy within {self._down_timeout_s:.0f}s (replicas: {', '.join(self.urls)})"
            )
        for url in sorted(pending):
            self._mark_down(url, "not healthy at start")

    async def generate(self, key: str, request: GenerateRequest) -> tuple[str, GenerateResponse]:
        """Generate on the replica `key` is pinned to, failing over while replicas are down.
        Returns the URL that answered and its generation."""
        while True:
            for url in rendezvous_order(key, self.up):
                try:
                    generation = await self._client.generate(url, request)
                except ReplicaUnavailable as exc:
                    self._mark_down(url, str(exc))
                    continue
                expected = self.weights_versions.get(url, 0)
                if generation.weights_version < expected:
                    # It restarted within the client's retries and answers on its startup weights: the
                    # generation is dropped, and the replica reloads the latest weights before it serves again.
                    self._mark_down(
                        url, f"it answered on weights version {generation.weights_version}, not {expected}"
                    )
                    continue
                # Versions only grow while a replica lives (the trainer's broadcasts move them too): one
                # answering below the highest seen has restarted.
                self.weights_versions[url] = max(expected, generation.weights_version)
                return url, generation
            await self._wait_for_any_up()

    async def load_weights(self, path: str) -> None:
        """Tell every live replica to load the checkpoint at `path` (concurrently). A replica that cannot
        be reached is marked down and loads `path` when it comes back."""
        self._weights_path = path
        urls = self.up
        results = await asyncio.gather(
            *(self._client.load_weights(url, path) for url in urls), return_exceptions=True
        )
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, ReplicaUnavailable):
                self._mark_down(url, str(result))
            elif isinstance(result, BaseException):
                raise result
            else:
                self.weights_versions[url] = result

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe

    def _mark_down(self, url: str, why: str) -> None:
        if url in self._down:
            return
        self._down.add(url)
        self._metrics.replicas_up.set(len(self.up))
        log.error(
            "engine replica %s marked down (%s); %d of %d replicas up", url, why, len(self.up), len(self.urls)
        )
        if not self.up:
            self._any_up.clear()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_down_replicas())

    async def _wait_for_any_up(self) -> None:
        try:
            await asyncio.wait_for(self._any_up.wait(), timeout=self._down_timeout_s)
        except TimeoutError:
            raise NoReplicaAvailable(
                f"no engine replica answered for {self._down_timeout_s:.0f}s (replicas: {', '.join(self.urls)})"
            ) from None

    async def _probe_down_replicas(self) -> None:
        while self._down:
            await asyncio.sleep(self._probe_interval_s)
            for url in sorted(self._down):
                if await self._revive(url):
                    self._down.discard(url)
                    self._metrics.replicas_up.set(len(self.up))
                    self._any_up.set()
                    log.warning(
                        "engine replica %s is back; %d of %d replicas up", url, len(self.up), len(self.urls)
                    )

    async def _revive(self, url: str) -> bool:
        path = self._weights_path
        if self.catch_up is not None:
            ready, path = self.catch_up()
            if not ready:
                return False
        try:
            version = await self._client.health(url)
            if path is not None:
                version = await self._client.load_weights(url, path)
        except (httpx.HTTPError, EngineError, ValueError, KeyError) as exc:
            # Every probe interval for as long as it stays down: "marked down" and "is back" are the news.
            log.debug("engine replica %s still down: %s", url, exc)
            return False
        self.weights_versions[url] = version
        return True
