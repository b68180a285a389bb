"""`rawmm operator` (as a process, against the emulator) and `rawmm manifests`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from kube.emulator import Cluster, emulated_cluster
from operator_samples import CPU_ONLY, ISSUE_EXAMPLE, rlrun
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from rawmm.cli import main
from rawmm_operator.crd import crd_yaml


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as running:
        yield running


@pytest.mark.cluster
@pytest.mark.slow
async def test_operator_command_serves_liveness_and_metrics(cluster: Cluster, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulator", "cluster": {"server": cluster.url}}],
                "users": [{"name": "test", "user": {}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
                "current-context": "emulator",
            }
        )
    )
    liveness, metrics = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "RAWMM_POD_MONITOR": "false"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    command = [sys.executable, "-m", "rawmm.cli", "operator", "--all-namespaces", "--host", "127.0.0.1"]
    command += [f"--liveness-port={liveness}", f"--metrics-port={metrics}", "--resync-seconds=1"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, process.stdout.read() if process.stdout else ""
                try:
                    if (await client.get(f"http://127.0.0.1:{liveness}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no liveness endpoint"
                await asyncio.sleep(0.1)

            response = await cluster.emulator.post(
                "/apis/rawmm.dev/v1alpha1/namespaces/ml/rlruns", json=rlrun("exp", CPU_ONLY)
            )
            assert response.status < 300
            deadline = time.monotonic() + 30
            while True:
                text = (await client.get(f"http://127.0.0.1:{metrics}/metrics")).text
                phases = samples(text, "rawmm_rlruns")
                if phases.get((("phase", "Pending"),)) == 1.0:
                    break
                assert time.monotonic() < deadline, text
                await asyncio.sleep(0.1)
            assert samples(text, "rawmm_operator_reconciles_total")[(("result", "success"),)] >= 1
            assert samples(text, "rawmm_operator_reconcile_seconds_count")[()] >= 1
            assert cluster.object("apps/v1/statefulsets", "ml", "exp-engine") is not None
            assert not cluster.objects("monitoring.coreos.com/v1/podmonitors")  # RAWMM_POD_MONITOR=false
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = await asyncio.to_thread(process.communicate, timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, output


def test_operator_command_without_a_cluster_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["operator", "--metrics-port", "0"]) == 2
    assert "no Kubernetes configuration" in capsys.readouterr().err


def test_operator_command_rejects_bad_pod_monitor_labels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "--pod-monitor-labels", "[1]"]) == 2
    assert "--pod-monitor-labels must be a JSON object" in capsys.readouterr().err


def test_manifests_writes_checks_and_prints_the_crd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["manifests", "--out-dir", str(tmp_path), "--check"]) == 1
    assert main(["manifests", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "rlruns.rawmm.dev.yaml").read_text() == crd_yaml()
    assert main(["manifests", "--out-dir", str(tmp_path), "--check"]) == 0
    capsys.readouterr()
    assert main(["manifests", "--print"]) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_manifests_render_prints_the_children_of_an_rlrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(rlrun("exp", ISSUE_EXAMPLE)))
    assert main(["manifests", "--render", str(path)]) == 0
    kinds = [doc["kind"] for doc in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds.count("Job") == 2 and "StatefulSet" in kinds and "ConfigMap" in kinds
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(rlrun("exp", {**ISSUE_EXAMPLE, "inference": {"gpus": 0}})))
    assert main(["manifests", "--render", str(bad)]) == 2
    assert "the vllm engine needs gpus >= 1" in capsys.readouterr().err


def test_manifests_render_queues_the_jobs_of_an_rlrun_with_a_kueue_label(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rawmm_operator.objects import QUEUE_LABEL

    body = rlrun("exp", ISSUE_EXAMPLE)
    body["metadata"]["labels"] = {QUEUE_LABEL: "team-a"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["manifests", "--render", str(path)]) == 0
    jobs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc["kind"] == "Job"]
    assert jobs and all(job["metadata"]["labels"][QUEUE_LABEL] == "team-a" for job in jobs)
    assert all(job["spec"]["suspend"] is True for job in jobs)  # Kueue admits them


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: RLRun\nmetadata: [1]\nspec: {}\n", "metadata must be a mapping"),
        ("kind: RLRun\nmetadata: {name: 5}\nspec: {}\n", "metadata must be a mapping"),
        ("kind: RLRun\nmetadata: {name: a, labels: [x]}\nspec: {}\n", "metadata must be a mapping"),
        ("kind: RLRun\nmetadata: {name: a\n", "run.yaml:3:1: not valid YAML"),
    ],
)
def test_manifests_render_of_a_malformed_rlrun_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["manifests", "--render", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.slow
def test_the_operator_imports_no_engine_or_trainer_code() -> None:
    code = (
        "import sys, rawmm_operator.main, rawmm.commands.operator\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'vllm'}"
        # rawmm.contract is the light base: rawmm.config takes the presets from its family registry.
        " or m.startswith(('rawmm.materialize', 'rawmm.serving', 'rawmm.rl')))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
