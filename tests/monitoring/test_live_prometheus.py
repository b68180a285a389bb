"""Dashboards and alerts against a live Prometheus (Debian's package, unpacked by `make install`) scraping
the real exporters on loopback:

- a tiny RL run (`rawmm run`: a `rawmm serve` engine, `rawmm orchestrate`, `rawmm train` on the tiny
  Qwen2-VL), whose engine this test also drives with cache misses, hits, a concurrent burst and bad refs;
- the `rawmm operator` process reconciling a valid and an invalid RLRun on the API emulator.

Targets carry the labels prometheus-operator gives a pod's target (namespace, pod, container, job), so the
dashboards' variables resolve as they would in a cluster. Every panel query and every variable of every
dashboard must return data, and the invalid-ref alert must fire on the driven reasons.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from emulated_operator import EmulatedOperator
from monitoring_helpers import (
    REPO,
    Prometheus,
    ScrapeTarget,
    as_prometheus_query,
    dashboards,
    panel_queries,
    rule_groups,
    stop_process,
    variable_queries,
    wait_until,
)
from ports import free_port

RUN_NAMESPACE = "ml"
RUN_NAME = "tiny"
# The labels prometheus-operator puts on the targets of a run's PodMonitor (job = "<namespace>/<monitor>").
RUN_LABELS = {"namespace": RUN_NAMESPACE, "job": f"{RUN_NAMESPACE}/{RUN_NAME}"}
DRIVEN_REASONS = {"hash_mismatch", "malformed_ref", "outside_offload_root", "missing_file"}


def run_config(tmp_path: Path, model: Path, ports: dict[str, int]) -> Path:
    """A tiny local run long enough to outlive the test (the test stops it)."""
    config = {
        "name": RUN_NAME,
        "model": {"path": str(model), "preset": "qwen2_vl"},
        "shared_dir": "shared",
        # Small enough that the multi-turn rollouts' images evict each other.
        "inference": {
            "engine": "transformers",
            "replicas": 1,
            "materialize_cache_size": "1Mi",
            "base_port": ports["engine"],
        },
        # The smallest steps that still train: the first trainer step is what the test waits for longest.
        "orchestrator": {
            "environment": {"name": "shapes-multiturn", "args": {"views": 2, "image_size": 56}},
            "prompts_per_step": 1,
            "rollouts_per_prompt": 2,
            "max_turns": 2,
            "max_tokens": 4,
        },
        "trainer": {"steps": 1000, "learning_rate": 1.0e-4, "missing_image_policy": "zero_loss"},
        "monitoring": {
            "orchestrator_metrics_port": ports["orchestrator"],
            "trainer_metrics_port": ports["trainer"],
        },
        # The GC process: the offload volume's usage for its dashboard panels.
        "offload": {"retention": {"enabled": True, "metrics_port": ports["gc"]}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class EngineDriver:
    """Requests to the run's engine built with the orchestrator's own renderer, and refs broken on purpose."""

    def __init__(self, url: str, run_dir: Path) -> None:
        from rawmm.contract import OffloadStore
        from rawmm.rl.orchestrator.rollout import PromptRenderer

        effective = yaml.safe_load((run_dir / "run-config.yaml").read_text())
        self.offload_root = Path(effective["shared_dir"]) / "images"
        model = effective["model"]
        self.renderer = PromptRenderer(
            model["path"], model["preset"], model["processor_backend"], OffloadStore(self.offload_root)
        )
        self.http = httpx.Client(base_url=url, timeout=60)
        self._colour = 0

    def new_request(self) -> dict[str, Any]:
        """A one-image prompt whose image the engine has not seen."""
        from PIL import Image

        self._colour += 1
        buffer = io.BytesIO()
        Image.new("RGB", (64, 48), (self._colour * 37 % 256, self._colour * 91 % 256, 7)).save(buffer, "PNG")
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": buffer.getvalue()},
                    {"type": "text", "text": "shape?"},
                ],
            }
        ]
        prompt = self.renderer.render(self.renderer.offload(messages))
        return {
            "prompt_token_ids": prompt.token_ids,
            "features": prompt.features(),
            "sampling": {"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "seed": 0, "logprobs": False},
        }

    def generate(self, request: dict[str, Any]) -> httpx.Response:
        return self.http.post("/v1/rawmm/generate", json=request)

    def broken(self, request: dict[str, Any], reason: str) -> dict[str, Any]:
        """`request` with its image ref broken so that the engine rejects it for `reason`."""
        from rawmm.contract import RawImageDescriptor, encode_ref, parse_ref

        request = copy.deepcopy(request)
        features = request["features"]
        (modality,) = features["kwargs_data"]
        ref = parse_ref(features["kwargs_data"][modality][0])
        descriptor = ref.descriptor().to_dict()
        if reason == "malformed_ref":
            features["kwargs_data"][modality][0] = "mmraw:{not json"
            return request
        if reason == "hash_mismatch":  # the request's hash disagrees with its ref
            features["mm_hashes"][modality][0] = "f" * len(ref.mm_hash)
            return request
        if reason == "outside_offload_root":
            descriptor["raw_image_uri"] = "file:///etc/hostname"
        elif reason == "missing_file":
            descriptor["raw_image_uri"] = ref.raw_image_uri.replace(ref.mm_hash[:8], "00000000")
        features["kwargs_data"][modality][0] = encode_ref(
            RawImageDescriptor.from_dict(descriptor), ref.mm_hash
        )
        return request

    def drive(self) -> None:
        """Misses, hits, a concurrent burst on one new image (in-flight joins), and every driven bad ref."""
        first = self.new_request()
        for _ in range(3):  # a miss, then hits
            response = self.generate(first)
            assert response.status_code == 200, response.text
        burst = self.new_request()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for response in pool.map(self.generate, [burst] * 4):
                assert response.status_code == 200, response.text
        for reason in sorted(DRIVEN_REASONS):
            response = self.generate(self.broken(self.new_request(), reason))
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["type"], error["reason"]) == ("invalid_mm_image_ref", reason), error

    def close(self) -> None:
        self.http.close()


def _has_finite_value(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def _dashboard_checks(prometheus: Prometheus) -> dict[str, Callable[[], bool]]:
    """Every dashboard query by (dashboard, panel, query), with the dashboard's variables set to the values
    their own queries offer now (as Grafana would)."""
    checks: dict[str, Callable[[], bool]] = {}
    for name, dashboard in dashboards().items():
        variables: dict[str, str] = {}
        for variable, selector, label in variable_queries(dashboard):
            values = prometheus.label_values(label, as_prometheus_query(selector, variables))
            checks[f"{name}: ${variable}"] = lambda values=values: bool(values)
            variables[variable] = "|".join(values) or "no-value"
        for title, expr in panel_queries(dashboard):
            query = as_prometheus_query(expr, variables)
            checks[f"{name}: {title}: {expr}"] = lambda query=query: _has_finite_value(
                prometheus.query(query)
            )
    return checks


@dataclass
class TinyRun:
    process: subprocess.Popen[Any]
    ports: dict[str, int]
    output_dir: Path
    log: Path

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['engine']}"

    def targets(self) -> list[ScrapeTarget]:
        pods = {
            "engine": f"{RUN_NAME}-engine-0",
            "orchestrator": f"{RUN_NAME}-orchestrator-x7k2p",
            "trainer": f"{RUN_NAME}-trainer-0-q9d4w",
            "gc": f"{RUN_NAME}-offload-gc-m3x8v",
        }
        return [
            ScrapeTarget(self.ports[c], {**RUN_LABELS, "pod": pod, "container": c}) for c, pod in pods.items()
        ]


@pytest.fixture
def tiny_run(tmp_path: Path, tiny_qwen2_vl: Path) -> Iterator[TinyRun]:
    """`rawmm run` of the tiny model: engine, orchestrator and trainer exporters on loopback ports."""
    ports = {name: free_port() for name in ("engine", "orchestrator", "trainer", "gc")}
    config = run_config(tmp_path, tiny_qwen2_vl, ports)
    log = tmp_path / "run.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rawmm.cli", "run", str(config), "--output-dir", str(tmp_path / "run")],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield TinyRun(process, ports, tmp_path / "run", log)
    finally:
        stop_process(process, timeout=60)


@pytest.fixture
def operator(tmp_path: Path) -> Iterator[EmulatedOperator]:
    """`rawmm operator` reconciling a valid RLRun and one it rejects (the vllm engine needs GPUs: a CEL
    rule, which the emulator does not run, so the operator's own check reports it)."""
    operator = EmulatedOperator(tmp_path)
    try:
        operator.start()
        operator.wait_serving_metrics()
        tiny = yaml.safe_load((REPO / "manifests" / "examples" / "tiny-cpu.yaml").read_text())
        tiny["metadata"]["namespace"] = RUN_NAMESPACE
        operator.create(tiny)
        invalid = copy.deepcopy(tiny)
        invalid["metadata"]["name"] = "needs-gpus"
        invalid["spec"]["inference"]["engine"] = "vllm"
        operator.create(invalid)
        yield operator
    finally:
        operator.stop()


@pytest.fixture
def prometheus(tmp_path: Path, tiny_run: TinyRun, operator: EmulatedOperator) -> Iterator[Prometheus]:
    operator_target = ScrapeTarget(
        operator.metrics_port,
        {
            "namespace": "rawmm-system",
            "job": "rawmm-metrics",
            "pod": "rawmm-operator-5d9c7",
            "container": "operator",
        },
    )
    prometheus = Prometheus(tmp_path, [*tiny_run.targets(), operator_target], rule_groups())
    try:
        prometheus.wait_ready()
        yield prometheus
    finally:
        prometheus.stop()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_every_dashboard_query_returns_data_and_the_invalid_ref_alert_fires(
    tiny_run: TinyRun, prometheus: Prometheus
) -> None:
    wait_until(
        lambda: _healthy(tiny_run.engine_url),
        f"the run's engine (log: {tiny_run.log})",
        180,
        tiny_run.process,
    )
    # Prometheus must have seen the engine before the bad refs: the alert is about new ones.
    wait_until(lambda: prometheus.query("rawmm_materialize_cache_capacity_bytes"), "a first scrape", 30)
    driver = EngineDriver(tiny_run.engine_url, tiny_run.output_dir)
    try:
        driver.drive()
    finally:
        driver.close()

    # Each query must return a number at some point while the run is live.
    pending = set(_dashboard_checks(prometheus))

    def all_returned_data() -> bool:
        for name, check in _dashboard_checks(prometheus).items():
            if name in pending and check():
                pending.discard(name)
        return not pending

    try:
        wait_until(all_returned_data, "data in every dashboard panel", timeout=240, process=tiny_run.process)
    except pytest.fail.Exception:
        pytest.fail(f"no data: {sorted(pending)}; targets: {prometheus.targets_up()}; log: {tiny_run.log}")

    def invalid_ref_reasons() -> set[str]:
        return {
            alert["labels"]["reason"]
            for alert in prometheus.firing_alerts()
            if alert["labels"]["alertname"] == "RawmmInvalidImageRefs"
            and alert["labels"]["pod"] == f"{RUN_NAME}-engine-0"
        }

    firing = wait_until(
        lambda: invalid_ref_reasons() >= DRIVEN_REASONS and invalid_ref_reasons(), "the alert", 30
    )
    assert firing == DRIVEN_REASONS


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
