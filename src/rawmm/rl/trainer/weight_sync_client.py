"""The trainer's control plane to every engine replica for a weight broadcast (rawmm.contract.weight_transfer).

It has the four methods of vLLM's ``VLLMWeightSyncClient`` protocol, fanned out over the replicas: a step
succeeds when every replica answered it, and the calls of a step run concurrently (the engines' ``update``
calls must all be open while the sender broadcasts). Requests carry the run's weights token.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rawmm.contract.engine_api import WEIGHTS_PATH, WeightsResponse
from rawmm.contract.weight_transfer import FINISH_PATH, INIT_PATH, START_PATH, UPDATE_PATH, InitResponse
from rawmm.contract.weights_token import auth_headers


class WeightSyncFailed(RuntimeError):
    """A replica refused or failed a step of the weight transfer."""

    def __init__(self, url: str, step: str, detail: str) -> None:
        super().__init__(f"engine {url}: weight transfer {step} failed: {detail}")
        self.url, self.step = url, step


class HttpWeightSyncClient:
    """vLLM's four-method weight-sync surface over the rawmm routes of ``urls``."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 600.0) -> None:
        if not urls:
            raise ValueError("a weight broadcast needs at least one engine URL")
        self.urls = list(dict.fromkeys(urls))
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="rawmm-weight-sync")

    def _post(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        try:
            response = httpx.post(f"{url}{path}", json=body, headers=auth_headers(), timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise WeightSyncFailed(url, path, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise WeightSyncFailed(url, path, f"HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def _all(self, path: str, bodies: Sequence[dict[str, Any] | None]) -> list[Any]:
        futures = [
            self._pool.submit(self._post, url, path, body)
            for url, body in zip(self.urls, bodies, strict=True)
        ]
        return [future.result() for future in futures]

    def init_weight_transfer_engine(self, init_infos: Sequence[dict[str, Any]]) -> list[str]:
        """One init info per replica (each takes its own rank); the dtype each replica serves."""
        answers = self._all(INIT_PATH, [{"init_info": info} for info in init_infos])
        return [InitResponse.model_validate(answer).served_dtype for answer in answers]

    def start_weight_update(self) -> None:
        self._all(START_PATH, [None] * len(self.urls))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all(UPDATE_PATH, [{"update_info": update_info}] * len(self.urls))

    def finish_weight_update(self, weight_version: str | None = None) -> dict[str, int]:
        """Each replica's new weights version, by URL."""
        answers = self._all(FINISH_PATH, [{"weight_version": weight_version}] * len(self.urls))
        return {
            url: WeightsResponse.model_validate(answer).weights_version
            for url, answer in zip(self.urls, answers, strict=True)
        }

    def load_weights(self, path: str) -> dict[str, int | WeightSyncFailed]:
        """Every replica loads the checkpoint at ``path`` (``/v1/rawmm/weights``, concurrently): its new
        weights version by URL, or why it did not (the others load it all the same)."""
        futures = [self._pool.submit(self._post, url, WEIGHTS_PATH, {"path": path}) for url in self.urls]
        results: dict[str, int | WeightSyncFailed] = {}
        for url, future in zip(self.urls, futures, strict=True):
            try:
                results[url] = WeightsResponse.model_validate(future.result()).weights_version
            except WeightSyncFailed as exc:
                results[url] = exc
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False)
