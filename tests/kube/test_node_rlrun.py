"""An RLRun that trains inside real pods: the chart's operator as a pod, the tiny-model Job and the CPU RLRun
of manifests/examples/ on the real node, from the images `make images` built — a vLLM-CPU engine serving raw
refs from the claim, the orchestrator reaching it by its per-replica DNS name, the trainer writing the
checkpoints the engine reloads — to Succeeded, with the status read from the pods' own /metrics. Then the
faults only real pods have: an engine pod deleted mid-run, the trainer's container killed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import rawmm
from kube import node
from kube.cluster import KubeCluster, wait_for
from kube.installs import RELEASE_NAMESPACE, helm_release, ready_operator_pod
from rawmm.contract.shared_dir import latest_step

# Each test runs a whole RLRun on 2 cores (the first waits for the run images' import, if still running).
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.run_images("trainer", "inference"),
]

EXAMPLES = node.REPO / "manifests" / "examples"
ON_REAL_NODE = node.for_real_node({})
# vLLM-CPU on a 2-core node: a 1 GiB KV cache (its default is 4 GiB) and no thread pinning (the cores are
# shared with the other pods).
VLLM_CPU_ENV = [
    {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
]
# Where a user pushed their own builds: the chart's one image setting points every run at them. The node has
# the built images under these names too (no registry: `ctr images tag`), so a pod that ran the published
# name would still start; the test checks the names the pods ran.
REGISTRY, TAG = "registry.rawmm.test/team", "0.1.0-cpu"
SMALL = {"requests": {"cpu": "100m", "memory": "1Gi"}}  # the real node has 2 CPUs for every pod of the run
RUN_TIMEOUT = 900


def published_image(name: str) -> str:
    return f"ghcr.io/rawmm/rawmm-{name}:{rawmm.__version__}"


def get(cluster: KubeCluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-o", "json", *args).stdout)


def example(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]


def on_real_node(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {**pod_spec, **ON_REAL_NODE}


def tiny_model_objects() -> list[dict[str, Any]]:
    """tiny-cpu-model.yaml, its Job placed on the real node with a smaller CPU request."""
    claim, job = example("tiny-cpu-model.yaml")
    template = job["spec"]["template"]
    template["spec"] = on_real_node(template["spec"])
    (container,) = template["spec"]["containers"]
    container["resources"]["requests"]["cpu"] = "500m"
    return [claim, job]


def cpu_run(name: str, steps: int) -> dict[str, Any]:
    """tiny-cpu.yaml on the real node, with the vLLM-CPU engine of the CPU inference image."""
    (run,) = example("tiny-cpu.yaml")
    spec = run["spec"]
    spec["inference"] = {
        **spec["inference"],
        **ON_REAL_NODE,
        "engine": "vllm",
        # vLLM on CPUs runs from an image of its CPU build, which the run names (the default is the CUDA one)
        "image": f"{REGISTRY}/rawmm-inference:{TAG}",
        "env": VLLM_CPU_ENV,
        "resources": SMALL,
    }
    for role in ("orchestrator", "trainer"):
        spec[role] = {**spec[role], **ON_REAL_NODE, "resources": SMALL}
    spec["trainer"]["steps"] = steps
    return {**run, "metadata": {"name": name}}


def pods_report(cluster: KubeCluster, namespace: str) -> str:
    """Every pod's phase, container states and log tail: what a failed wait shows."""
    lines = []
    for pod in get(cluster, "pods", "-n", namespace)["items"]:
        name = pod["metadata"]["name"]
        states = [
            (s["name"], s.get("restartCount"), s.get("state"))
            for s in pod["status"].get("containerStatuses", [])
        ]
        lines.append(f"--- {name}: {pod['status'].get('phase')} {json.dumps(states)[:600]}")
        lines.append(
            cluster.kubectl(
                "logs", name, "-n", namespace, "--all-containers", "--tail=25", check=False
            ).stdout
        )
    return "\n".join(lines)


def status(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(get(cluster, "rlrun", name, "-n", namespace).get("status", {}))


def wait_phase(cluster: KubeCluster, namespace: str, name: str, phase: str) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        current = status(cluster, namespace, name)
        if current.get("phase") == "Failed" and phase != "Failed":
            raise AssertionError(
                f"{name} failed: {json.dumps(current, indent=1)}\n{pods_report(cluster, namespace)}"
            )
        return current if current.get("phase") == phase else None

    try:
        result: dict[str, Any] = wait_for(reached, f"RLRun {name} {phase}", timeout=RUN_TIMEOUT, interval=2)
    except TimeoutError:
        pytest.fail(
            f"{json.dumps(status(cluster, namespace, name), indent=1)}\n{pods_report(cluster, namespace)}"
        )
    return result


def job_logs(cluster: KubeCluster, namespace: str, job: str) -> list[tuple[str, str]]:
    """(pod name, its log) of each pod the Job made, oldest first; none fails naming what the namespace and
    the operator say (the pods of a finished run's Jobs are kept, their logs with them)."""
    pods = get(cluster, "pods", "-n", namespace, "-l", f"job-name={job}")["items"]
    if not pods:
        said = [
            cluster.kubectl(*args, check=False).stdout
            for args in (
                ("get", "jobs,pods", "-n", namespace, "-o", "wide"),
                ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
                ("logs", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--tail=80"),
            )
        ]
        raise AssertionError(f"no pod of Job {job}:\n" + "\n".join(said))
    pods.sort(key=lambda p: p["metadata"]["creationTimestamp"])
    return [
        (
            p["metadata"]["name"],
            cluster.kubectl("logs", p["metadata"]["name"], "-n", namespace, check=False).stdout,
        )
        for p in pods
    ]


def events(log: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of `event` (the orchestrator's and trainer's per-step lines)."""
    found = []
    for line in log.splitlines():
        start = line.find("{")
        if start < 0 or f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found


@pytest.fixture(scope="module")
def operator_pod(real_node: KubeCluster) -> Iterator[str]:
    """The chart installed with its operator as a pod on the real node, then the run images imported; the
    operator pod's name."""
    values = {
        "operator": ON_REAL_NODE,
        "runs": {"podMonitor": {"enabled": False}, "images": {"registry": REGISTRY, "tag": TAG}},
    }
    with helm_release(real_node, values):
        # The operator first, as in test_node_operator (CI once saw its pod not Ready 180 s after the imports).
        name = str(ready_operator_pod(real_node)["metadata"]["name"])
        real_node.import_images("trainer", "inference")  # fails naming what `make images` did not build
        assert real_node.network is not None
        for image in ("trainer", "inference"):
            node.tag_image(real_node.network, published_image(image), f"{REGISTRY}/rawmm-{image}:{TAG}")
        yield name


@pytest.fixture(scope="module")
def model_claim(real_node: KubeCluster, operator_pod: str) -> Iterator[tuple[str, Path]]:
    """A namespace with tiny-cpu-model.yaml's claim holding the tiny checkpoint its Job wrote in a real pod;
    the namespace and the claim's directory on this machine (the test provisioner's hostPath)."""
    namespace = real_node.namespace("node-rlrun")
    for manifest in tiny_model_objects():
        real_node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    try:
        real_node.kubectl(
            "wait", "-n", namespace, "--for=condition=complete", "job/rawmm-tiny-model", "--timeout=300s"
        )
    except Exception:
        pytest.fail(pods_report(real_node, namespace))
    claim = get(real_node, "pvc", "rawmm-tiny-shared", "-n", namespace)
    volume = get(real_node, "pv", claim["spec"]["volumeName"])
    yield namespace, Path(volume["spec"]["hostPath"]["path"])
    real_node.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", check=False)


def test_a_cpu_rlrun_trains_to_succeeded_in_real_pods(
    real_node: KubeCluster, model_claim: tuple[str, Path]
) -> None:
    namespace, claim_dir = model_claim
    assert (claim_dir / "models" / "tiny-qwen2-vl" / "config.json").is_file()  # written by the Job's pod
    real_node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(cpu_run("tiny-cpu", steps=2)))
    done = wait_phase(real_node, namespace, "tiny-cpu", "Succeeded")

    # The run's pods ran the images the chart's setting names: the Jobs' pods (kept), and the engines'
    # StatefulSet (its pods are gone with the finished run).
    selector = "rawmm.dev/run=tiny-cpu"
    ran = {
        c["image"]
        for pod in get(real_node, "pods", "-n", namespace, "-l", selector)["items"]
        for c in pod["spec"]["containers"]
    }
    (engines,) = get(real_node, "statefulsets", "-n", namespace, "-l", selector)["items"]
    ran |= {c["image"] for c in engines["spec"]["template"]["spec"]["containers"]}
    assert ran == {f"{REGISTRY}/rawmm-{name}:{TAG}" for name in ("trainer", "inference")}, ran

    # The status carries what the operator scraped from the pods' /metrics while they ran: the trainer's step
    # and the engine's cache hit rate (maxTurns 3: a later turn resends the earlier images, hits). The
    # run's last read may meet the engine reloading the final checkpoint on a loaded node: it waits longer
    # and, if the run gave no window of its own, takes every lookup the engine counted.
    assert done["trainerStep"] == 2, done
    assert 0 < done.get("cacheHitRate", 0) <= 1, done
    # The orchestrator reached the engine by its per-replica DNS name and the engine answered on the weights
    # of every step: batch N was sampled on checkpoint N - 1 (max_async_level 1), reloaded from the claim.
    ((_, orchestrator_log),) = job_logs(real_node, namespace, "tiny-cpu-orchestrator")
    steps = events(orchestrator_log, "orchestrator_step")
    assert [s["step"] for s in steps] == [1, 2], orchestrator_log[-3000:]
    assert [s["weights_step"] for s in steps] == [0, 1], steps
    assert all(s["images_sent"] > 0 and s["rollouts"] > 0 for s in steps), steps
    # The run's directory on the claim holds the engine's offloaded images and both checkpoints.
    (run_dir,) = (claim_dir / "runs" / "tiny-cpu").iterdir()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_1",
        "step_2",
    ]
    assert any(p.is_file() for p in (run_dir / "images").rglob("*")), "no image offloaded to the claim"


def test_a_broadcast_rlrun_sends_every_steps_weights_from_the_trainer_pod_to_the_engine_pod(
    real_node: KubeCluster, model_claim: tuple[str, Path]
) -> None:
    """`trainer.weightTransfer: broadcast`: the engine pod joins the rendezvous the operator gives the trainer
    pod (its pod IP, port 29501) and takes every step's weights over the pod network, each step's batch
    sampled on the weights the trainer broadcast after the step before. The trainer runs compiled
    (`trainer.compile`): the trainer image carries the compiler it needs."""
    namespace, _ = model_claim
    run = cpu_run("broadcast", steps=3)
    run["spec"]["trainer"]["weightTransfer"] = "broadcast"
    run["spec"]["trainer"]["compile"] = True  # the image's compiler, in a pod
    real_node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(run))
    done = wait_phase(real_node, namespace, "broadcast", "Succeeded")
    assert done["trainerStep"] == 3, done
    ((_, trainer_log),) = job_logs(real_node, namespace, "broadcast-trainer")
    trained = events(trainer_log, "trainer_step")
    assert [(e["step"], e["weights_delivery"]) for e in trained] == [
        (step, "broadcast") for step in (1, 2, 3)
    ], trainer_log[-3000:]
    assert all(e["compiled_blocks"] > 0 for e in trained), trained
    ((_, orchestrator_log),) = job_logs(real_node, namespace, "broadcast-orchestrator")
    sampled = events(orchestrator_log, "orchestrator_step")
    assert [(s["step"], s["weights_step"]) for s in sampled] == [(1, 0), (2, 1), (3, 2)], sampled


def latest_checkpoint(claim_dir: Path, run: str) -> int:
    """The newest checkpoint step the run's trainer finished, read off the claim (0: none yet)."""
    for checkpoints in (claim_dir / "runs" / run).glob("*/checkpoints"):
        return latest_step(checkpoints)
    return 0


def wait_checkpoint(cluster: KubeCluster, namespace: str, claim_dir: Path, run: str, step: int) -> None:
    def reached() -> bool:
        if status(cluster, namespace, run).get("phase") in ("Failed", "Succeeded"):
            raise AssertionError(f"{run} ended before checkpoint {step}:\n{pods_report(cluster, namespace)}")
        return latest_checkpoint(claim_dir, run) >= step

    try:
        wait_for(reached, f"{run}: checkpoint {step}", timeout=RUN_TIMEOUT, interval=0.5)
    except TimeoutError:
        pytest.fail(pods_report(cluster, namespace))


def running_pod(cluster: KubeCluster, namespace: str, selector: str) -> dict[str, Any]:
    (pod,) = [
        p
        for p in get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
        if p["status"].get("phase") == "Running"
    ]
    return pod


def container_id(pod: dict[str, Any]) -> str:
    (container,) = pod["status"]["containerStatuses"]
    return str(container["containerID"]).split("://", 1)[1]


def test_a_cpu_rlrun_survives_a_deleted_engine_and_a_killed_trainer(
    real_node: KubeCluster, model_claim: tuple[str, Path]
) -> None:
    """The engine pod deleted after the first checkpoint (its StatefulSet makes a new one, which loads the
    latest weights before it serves); the trainer's process SIGKILLed after the second (the Job replaces the
    pod, which resumes from the latest checkpoint). The run still completes every step."""
    namespace, claim_dir = model_claim
    steps = 4  # the kill lands within a second or two of checkpoint 2; two more steps take far longer
    real_node.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(cpu_run("faults", steps=steps))
    )
    wait_checkpoint(real_node, namespace, claim_dir, "faults", 1)
    engine = running_pod(real_node, namespace, "rawmm.dev/run=faults,app.kubernetes.io/component=engine")
    real_node.kubectl("delete", "pod", engine["metadata"]["name"], "-n", namespace, "--wait=false")
    wait_checkpoint(real_node, namespace, claim_dir, "faults", 2)
    trainer = running_pod(real_node, namespace, "job-name=faults-trainer")
    assert real_node.network is not None
    node.signal_container(real_node.network, container_id(trainer), "SIGKILL")
    wait_phase(real_node, namespace, "faults", "Succeeded")

    # A new engine pod served the later steps; every step's batch was written.
    engines = get(
        real_node, "pods", "-n", namespace, "-l", "rawmm.dev/run=faults,app.kubernetes.io/component=engine"
    )
    assert engine["metadata"]["uid"] not in {p["metadata"]["uid"] for p in engines["items"]}
    ((_, orchestrator_log),) = job_logs(real_node, namespace, "faults-orchestrator")
    assert [s["step"] for s in events(orchestrator_log, "orchestrator_step")] == list(range(1, steps + 1))
    # The killed trainer's pod (137) was replaced once; the new one resumed after the latest checkpoint.
    (killed, _), (replacement, replacement_log) = job_logs(real_node, namespace, "faults-trainer")
    (state,) = get(real_node, "pod", killed, "-n", namespace)["status"]["containerStatuses"]
    assert state["state"]["terminated"]["exitCode"] == 137, state
    resumed = [e["step"] for e in events(replacement_log, "trainer_step")]
    assert resumed and resumed[0] > 2 and resumed[-1] == steps, replacement_log[-3000:]
    assert status(real_node, namespace, "faults")["trainerStep"] == steps


def test_a_failed_runs_other_pods_stop_in_place_and_keep_their_logs(
    real_node: KubeCluster, model_claim: tuple[str, Path]
) -> None:
    """The trainer stopped by SIGTERM after its first checkpoint (143: a failure, not a kill) fails the run;
    the operator stops the orchestrator's pod through its kubelet, which keeps the pod and its log."""
    namespace, claim_dir = model_claim
    real_node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(cpu_run("failing", steps=6)))
    wait_checkpoint(real_node, namespace, claim_dir, "failing", 1)
    trainer = running_pod(real_node, namespace, "job-name=failing-trainer")
    assert real_node.network is not None
    node.signal_container(real_node.network, container_id(trainer), "SIGTERM")
    failed = wait_phase(real_node, namespace, "failing", "Failed")
    assert failed["reason"] == "TrainerFailed", failed

    def stopped() -> dict[str, Any] | None:
        (pod,) = get(real_node, "pods", "-n", namespace, "-l", "job-name=failing-orchestrator")["items"]
        return pod if pod["status"].get("phase") == "Failed" else None

    pod = wait_for(stopped, "the orchestrator's pod stopped by its kubelet", timeout=120)
    assert pod["status"]["reason"] == "DeadlineExceeded", pod["status"]
    (state,) = pod["status"]["containerStatuses"]
    assert state["state"]["terminated"]["exitCode"] == 143, state  # SIGTERM, at once: not retried
    ((_, log),) = job_logs(real_node, namespace, "failing-orchestrator")
    assert [s["step"] for s in events(log, "orchestrator_step")][:1] == [1], log[-3000:]
    conditions = {c["type"]: c for c in status(real_node, namespace, "failing")["conditions"]}
    assert conditions["OrchestratorRunning"]["reason"] == "Stopped", conditions
    assert status(real_node, namespace, "failing")["reason"] == "TrainerFailed"
