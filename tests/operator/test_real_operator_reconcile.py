"""The operator's production behaviour (#12) on a real control plane (tests/kube): the chart installed with
Helm, the real `rawmm operator` running as the chart's ServiceAccount, kube-controller-manager's Job,
StatefulSet and garbage-collector controllers, kwok's fake nodes.

Server-side apply reverts drift and prunes children no longer built; a Job whose template changed is
replaced; a pending claim says why; a child the server refuses is a condition and a retry, not a failed
run; an eviction does not fail the run; a finished run releases its pods; a queue's suspend is never
overruled; child watches are filtered by the run label on the server; events only on transitions;
activeDeadlineSeconds and ttlSecondsAfterFinished."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml
from kube.cluster import KubeCluster, OperatorProcess, wait_for
from kube.installs import RELEASE_NAMESPACE, helm_release
from prometheus_client.parser import text_string_to_metric_families

from rawmm_operator.objects import RUN_LABEL
from rawmm_operator.pods import TEMPLATE_HASH
from rawmm_operator.spec import default_image

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
TIMEOUT = 60
# Small enough for the fake nodes (3 x 8 GPUs), the default (test) storage class binds its claim.
SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-VL-4B-Instruct", "preset": "qwen3_vl"},
    "offload": {"size": "20Gi", "retainOnDelete": False},
    "inference": {"replicas": 2, "gpus": 1, "materializeCacheSize": "4Gi"},
    "trainer": {"gpusPerNode": 2, "steps": 10},
}
CHILD_KINDS = "configmaps,services,statefulsets,jobs,podmonitors"


@dataclass(frozen=True)
class Operator:
    user: str  # the chart's ServiceAccount, as the API server names it
    process: OperatorProcess
    # the audit log's size when this operator started: other modules' installs reuse the account's name
    audit_offset: int

    def audit_events(self, cluster: KubeCluster) -> list[dict[str, Any]]:
        return cluster.audit_events(self.user, since=self.audit_offset)

    def reconciles(self) -> float:
        """Passes so far (every result): a clock of the operator's own work."""
        text = httpx.get(self.process.metrics_url, timeout=5).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "rawmm_operator_reconciles_total"
        )


@pytest.fixture(scope="module")
def operator(kube_cluster: KubeCluster) -> Iterator[Operator]:
    """The chart (with the prometheus-operator CRDs present) and its operator, cluster-wide, as the
    chart's ServiceAccount: a grant the behaviour needs and the chart lacks is a real 403 here."""
    kube_cluster.monitoring_crds(True)
    with helm_release(kube_cluster) as release:
        (account,) = [
            doc["metadata"]["name"]
            for doc in yaml.safe_load_all(release["manifest"])
            if doc and doc["kind"] == "ServiceAccount"
        ]
        kubeconfig = kube_cluster.service_account_kubeconfig(RELEASE_NAMESPACE, account)
        offset = kube_cluster.audit_log.stat().st_size
        with kube_cluster.operator(kubeconfig, args=("--resync-seconds=2",)) as process:
            yield Operator(f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}", process, offset)


@dataclass
class Run:
    cluster: KubeCluster
    namespace: str
    operator: Operator
    name: str = "exp"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.cluster.kubectl(*args, "-n", self.namespace, input=input, check=check).stdout

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.cluster.kubectl("get", kind, name, "-n", self.namespace, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def create(self, spec: dict[str, Any], labels: dict[str, str] | None = None) -> None:
        body = {
            "apiVersion": "rawmm.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": self.name, "labels": labels or {}},
            "spec": spec,
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(body))

    def patch(self, spec: dict[str, Any]) -> None:
        self.kubectl("patch", "rlrun", self.name, "--type=merge", "-p", json.dumps({"spec": spec}))

    def status(self) -> dict[str, Any]:
        return self.get("rlrun", self.name).get("status") or {}

    def condition(self, type_: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions", []) if c["type"] == type_), {})

    def children(self) -> dict[tuple[str, str], dict[str, Any]]:
        items = self.get(CHILD_KINDS, "-l", f"{RUN_LABEL}={self.name}")["items"]
        return {(item["kind"], item["metadata"]["name"]): item for item in items}

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"{RUN_LABEL}={self.name},app.kubernetes.io/component={component}"
        return self.get("pods", "-l", selector)["items"]

    def running(self, component: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(component) if p["status"].get("phase") == "Running"]

    def until(self, check: Any, what: str, timeout: float = TIMEOUT) -> Any:
        try:
            return wait_for(check, what, timeout, 0.3)
        except TimeoutError as exc:
            log = self.operator.process.log()[-4000:]
            raise AssertionError(f"{exc}; status {self.status()}\n--- operator log ---\n{log}") from None

    def wait_running(self) -> None:
        for component, count in (
            ("engine", SPEC["inference"]["replicas"]),
            ("orchestrator", 1),
            ("trainer", 1),
        ):
            self.until(lambda c=component, n=count: len(self.running(c)) == n, f"{count} {component} Running")
        self.until(lambda: self.status().get("phase") == "Running", "phase Running")

    def events(self) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind=RLRun,involvedObject.name={self.name}"
        return self.get("events", "--field-selector", selector)["items"]

    def set_pod_status(self, pod: str, status: dict[str, Any]) -> None:
        self.kubectl(
            "patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
        )


@pytest.fixture
def run(kube_cluster: KubeCluster, operator: Operator) -> Iterator[Run]:
    namespace = kube_cluster.namespace("op")
    yield Run(kube_cluster, namespace, operator)
    kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    # Then its pods at once (a terminating namespace takes no new ones), the Job pods' tracking finalizer
    # included: the fake nodes finish them late, and until then they hold their node's GPUs for the
    # scheduler, where a later test's pods would not fit beside them.
    pods = kube_cluster.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.split()
    for pod in pods:
        kube_cluster.kubectl(
            "patch",
            pod,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
    if pods:
        kube_cluster.kubectl(
            "delete", *pods, "-n", namespace, "--grace-period=0", "--force", "--wait=false", check=False
        )


def test_children_are_applied_server_side_drift_is_reverted_and_unbuilt_children_are_pruned(run: Run) -> None:
    run.create({**SPEC, "trainer": {**SPEC["trainer"], "nodes": 2}})
    run.until(lambda: ("Service", "exp-trainer") in run.children(), "the trainer rendezvous Service")
    run.until(lambda: ("PodMonitor", "exp") in run.children(), "the PodMonitor")
    children = run.children()
    engines = children[("StatefulSet", "exp-engine")]
    managed = run.get("statefulset", "exp-engine", "--show-managed-fields")["metadata"]["managedFields"]
    assert ("rawmm-operator", "Apply") in {(f["manager"], f["operation"]) for f in managed}
    # An image the spec does not name is the operator's release, resolved now (the stored spec has none).
    stored = run.get("rlrun", run.name)["spec"]
    assert stored["trainer"]["image"] == ""
    trainer_job = children[("Job", "exp-trainer")]
    assert trainer_job["spec"]["template"]["spec"]["containers"][0]["image"] == default_image("trainer")
    # The weights token exists, owned by the run, and reaches the engines.
    secret = run.get("secret", "exp-weights")
    assert secret["data"]["token"] and secret["metadata"]["ownerReferences"][0]["name"] == run.name
    env = engines["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "RAWMM_WEIGHTS_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "exp-weights", "key": "token"}},
    } in env

    # Drift on fields the operator owns is reverted.
    run.kubectl("scale", "statefulset", "exp-engine", "--replicas=5")
    run.kubectl("label", "service", "exp-engine", f"{RUN_LABEL}=someone-else", "--overwrite")
    run.until(lambda: run.get("statefulset", "exp-engine")["spec"]["replicas"] == 2, "replicas reverted")
    run.until(
        lambda: run.get("service", "exp-engine")["metadata"]["labels"][RUN_LABEL] == run.name,
        "label reverted",
    )

    # Children no longer built are deleted.
    run.patch({"monitoring": {"podMonitor": False}})
    run.until(lambda: run.find("podmonitor", "exp") is None, "the PodMonitor pruned")
    run.patch({"trainer": {"nodes": 1}})
    run.until(lambda: run.find("service", "exp-trainer") is None, "the rendezvous Service pruned")
    # ... and the trainer Job, whose template changed (completions), replaced by a new one.
    replaced = run.until(
        lambda: (
            (job := run.find("job", "exp-trainer"))
            and job["metadata"]["uid"] != trainer_job["metadata"]["uid"]
            and job
        ),
        "the trainer Job replaced",
    )
    assert replaced["spec"]["completions"] == 1
    assert run.until(lambda: run.condition("Reconciled").get("reason") == "Applied", "Reconciled again")


def test_a_job_whose_template_changed_is_replaced_after_its_pods_are_gone(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    (old_pod,) = run.running("trainer")
    old_job = run.get("job", "exp-trainer")
    run.patch({"trainer": {"steps": 20}})

    def replaced() -> dict[str, Any] | None:
        job = run.find("job", "exp-trainer")
        return job if job and job["metadata"]["uid"] != old_job["metadata"]["uid"] else None

    new_job = run.until(replaced, "a new trainer Job")
    assert (
        new_job["metadata"]["annotations"][TEMPLATE_HASH] != old_job["metadata"]["annotations"][TEMPLATE_HASH]
    )
    config = yaml.safe_load(run.get("configmap", "exp-config")["data"]["run.yaml"])
    assert config["trainer"]["steps"] == 20
    # The new Job's pods start only once the old one's are gone: never two trainers on one checkpoint dir.
    run.until(lambda: len(run.running("trainer")) == 1, "the new trainer pod Running")
    pods = run.pods("trainer")
    assert [p["metadata"]["uid"] for p in pods] != [old_pod["metadata"]["uid"]] and len(pods) == 1
    assert run.status()["phase"] == "Running"


def test_a_pending_claim_says_why(run: Run) -> None:
    run.create({**SPEC, "offload": {"size": "20Gi", "storageClassName": "nfs-client"}})
    volume = run.until(
        lambda: (c := run.condition("OffloadVolumeReady")) and "nfs-client" in c.get("message", "") and c,
        "the claim's event in OffloadVolumeReady",
    )
    assert volume["status"] == "False" and volume["reason"] == "ClaimPending"
    assert re.search(r"is Pending: \w+: ", volume["message"]), volume["message"]  # "<reason>: <message>"
    assert run.status()["phase"] == "Pending"


def shared_dir(run: Run, name: str) -> str:
    """The run directory `name`'s pods read from its ConfigMap."""
    config = yaml.safe_load(run.get("configmap", f"{name}-config")["data"]["run.yaml"])
    return str(config["shared_dir"])


def test_runs_on_one_claim_each_write_their_own_directory_and_a_new_run_starts_afresh(run: Run) -> None:
    """Two RLRuns on one existingClaim, and a run deleted and applied again: each run's images, batches
    and checkpoints go to `/shared/runs/<name>/<uid>`, never to another's (nor resume from them)."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "team-shared"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "50Gi"}}},
    }
    run.kubectl("apply", "-f", "-", input=json.dumps(claim))
    spec = {
        **SPEC,
        "inference": {**SPEC["inference"], "replicas": 1},
        "offload": {"existingClaim": "team-shared"},
    }
    first, second = (
        Run(run.cluster, run.namespace, run.operator, "a"),
        Run(run.cluster, run.namespace, run.operator, "b"),
    )
    for each in (first, second):
        each.create(spec)
    dirs = {}
    for each in (first, second):
        uid = each.get("rlrun", each.name)["metadata"]["uid"]
        dirs[each.name] = run.until(
            lambda e=each: run.find("configmap", f"{e.name}-config") and shared_dir(run, e.name), "its config"
        )
        assert dirs[each.name] == f"/shared/runs/{each.name}/{uid}"
        engine = run.until(lambda e=each: run.find("statefulset", f"{e.name}-engine"), "its engines")
        (container,) = engine["spec"]["template"]["spec"]["containers"]
        assert container["args"][container["args"].index("--offload-root") + 1] == f"{dirs[each.name]}/images"
        (directories,) = engine["spec"]["template"]["spec"]["initContainers"]
        assert f"{dirs[each.name]}/checkpoints" in directories["command"]
    run.kubectl("delete", "rlrun", "a", "--wait=true")
    first.create(spec)
    again = run.until(
        lambda: (d := run.find("configmap", "a-config") and shared_dir(run, "a")) and d != dirs["a"] and d,
        "the new run's config",
    )
    assert again.startswith("/shared/runs/a/") and again != dirs["a"]


def test_a_claim_left_by_an_earlier_run_that_differs_from_the_spec_says_what_to_do(run: Run) -> None:
    """retainOnDelete kept the claim; the run is applied again with another class: the server refuses to
    change the claim, and the run says it is an earlier run's and how to get the new one."""
    run.create(
        {**SPEC, "offload": {"size": "20Gi", "storageClassName": "rawmm-test", "retainOnDelete": True}}
    )
    run.until(lambda: run.condition("OffloadVolumeReady").get("reason") == "Bound", "the claim Bound")
    run.kubectl("delete", "rlrun", run.name, "--wait=true")
    assert run.find("pvc", "exp-offload") is not None  # retained
    run.create({**SPEC, "offload": {"size": "20Gi", "storageClassName": "fast-ssd", "retainOnDelete": True}})
    volume = run.until(
        lambda: (c := run.condition("OffloadVolumeReady")) and c.get("reason") == "ClaimConflict" and c,
        "OffloadVolumeReady=False ClaimConflict",
    )
    assert volume["status"] == "False"
    assert "left from an earlier run" in volume["message"] and "'rawmm-test'" in volume["message"], volume
    assert f"kubectl delete pvc exp-offload -n {run.namespace}" in volume["message"], volume
    assert run.status()["phase"] != "Running"


def test_a_refused_child_is_a_condition_and_retried_never_a_failed_run(run: Run) -> None:
    """An admission policy (as a webhook or a quota would) refuses the trainer Job: the run says so in
    `Reconciled` and retries; once the policy goes, the Job is created. The run never fails for it."""
    policy = f"no-trainers-{run.namespace}"
    objects = [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": policy},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["batch"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["jobs"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": "!object.metadata.name.endsWith('-trainer')",
                        "message": "no trainers here",
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": policy},
            "spec": {
                "policyName": policy,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": run.namespace}}
                },
            },
        },
    ]
    manifest = "\n---\n".join(json.dumps(o) for o in objects)
    run.cluster.kubectl("apply", "-f", "-", input=manifest)
    try:
        probe = ("create", "job", "probe-trainer", "--image=x", "--dry-run=server")
        run.until(
            lambda: run.cluster.kubectl(*probe, "-n", run.namespace, check=False).returncode != 0,
            "the policy",
        )
        run.create(SPEC)
        reconciled = run.until(
            lambda: (c := run.condition("Reconciled")) and c.get("reason") == "ChildRejected" and c,
            "the refused Job in Reconciled",
        )
        assert reconciled["status"] == "False" and "no trainers here" in reconciled["message"], reconciled
        assert "Job/exp-trainer" in reconciled["message"]
        assert run.find("job", "exp-orchestrator") is not None  # the other children are applied
        assert run.status()["phase"] != "Failed"
        assert ("Warning", "ChildRejected") in {(e["type"], e["reason"]) for e in run.events()}
        # The operator's log names the run and says what the server refused (not only "Handler succeeded").
        rejected = f"rlrun {run.namespace}/exp: the API server rejected Job/exp-trainer"
        run.until(lambda: rejected in run.operator.process.log(), "the rejection in the operator's log")
        lines = [line for line in run.operator.process.log().splitlines() if rejected in line]
        assert "WARNING" in lines[0] and "no trainers here" in lines[0], lines[0]
    finally:
        run.cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=manifest)
    # Retried with backoff (at most a minute apart): the Job appears once nothing refuses it.
    run.until(lambda: run.find("job", "exp-trainer") is not None, "the trainer Job", timeout=120)
    run.until(lambda: run.condition("Reconciled").get("reason") == "Applied", "Reconciled again")
    # Each transition is a log line naming the run, as its event.
    assert f"rlrun {run.namespace}/exp: Applied: Reconciled=True" in run.operator.process.log()


def test_a_child_whose_patch_cannot_be_built_is_rejected_and_the_pass_goes_on(run: Run) -> None:
    """Two spread constraints with the same list-map keys: server-side apply cannot build the trainer Job's
    patch and answers 500. That is the child's fault, not the server's: the run says so in `Reconciled`,
    the other children are applied and the status is written (a retried 500 wrote none)."""
    twice = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
    trainer = {**SPEC["trainer"], "topologySpreadConstraints": [twice, dict(twice)]}
    run.create({**SPEC, "trainer": trainer})
    reconciled = run.until(
        lambda: (c := run.condition("Reconciled")) and c.get("reason") == "ChildRejected" and c,
        "the unbuildable Job in Reconciled",
    )
    assert "Job/exp-trainer" in reconciled["message"] and "500" in reconciled["message"], reconciled
    assert run.find("job", "exp-orchestrator") is not None
    assert run.status()["phase"] != "Failed"


def test_a_killed_trainer_is_replaced_twice_then_fails_the_run(run: Run) -> None:
    """SIGKILL (137: the OOM killer, kill -9) is retried, KILLED_RETRIES times; the next one fails the run."""
    run.create(SPEC)
    run.wait_running()
    killed: set[str] = set()
    for attempt in range(3):
        (pod,) = run.until(
            lambda: [p for p in run.running("trainer") if p["metadata"]["name"] not in killed],
            f"trainer pod {attempt + 1} running",
        )
        killed.add(pod["metadata"]["name"])
        run.cluster.finish_pod(run.namespace, pod["metadata"]["name"], 137)
        if attempt < 2:
            run.until(
                lambda: [p for p in run.pods("trainer") if p["metadata"]["name"] not in killed],
                f"replacement {attempt + 1}",
            )
            assert run.status().get("phase") != "Failed", run.status()
    run.until(lambda: run.status().get("phase") == "Failed", "phase Failed after the third kill")
    assert run.status()["reason"] == "TrainerFailed"


def test_an_eviction_does_not_fail_the_run_and_a_replacement_pod_starts(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    (pod,) = run.running("trainer")
    # What the kubelet reports for a pod evicted by a drain or preempted: Failed with DisruptionTarget.
    run.set_pod_status(
        pod["metadata"]["name"],
        {
            "phase": "Failed",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "drain",
                }
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "image": pod["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 137, "reason": "Error"}},
                }
            ],
        },
    )
    replacement = run.until(
        lambda: [p for p in run.running("trainer") if p["metadata"]["uid"] != pod["metadata"]["uid"]],
        "a replacement trainer pod",
    )
    assert len(replacement) == 1
    job = run.get("job", "exp-trainer")
    assert not [
        c for c in job["status"].get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"
    ]
    # The operator reports the run Provisioning while the replacement starts, Running once it sees it run.
    run.until(lambda: run.status()["phase"] == "Running", "the run Running again")


def test_a_failed_run_stops_its_other_pods_in_place_and_keeps_them(run: Run) -> None:
    run.create({**SPEC, "offload": {**SPEC["offload"], "retention": {"enabled": True}}})
    run.wait_running()
    run.until(lambda: len(run.running("offload-gc")) == 1, "the offload GC Running")
    (trainer,) = run.running("trainer")
    run.cluster.finish_pod(run.namespace, trainer["metadata"]["name"], 1)
    run.until(lambda: run.status().get("phase") == "Failed", "phase Failed")
    # The orchestrator, which would wait forever for the trainer's checkpoints, and the offload GC are stopped
    # by their kubelet (an active deadline already past), not suspended: suspending deletes their pods and
    # logs. (tests/kube/test_node_rlrun.py shows a real kubelet stop them; kwok's fake one ends them here.)
    for component in ("orchestrator", "offload-gc"):
        (pod,) = run.until(
            lambda c=component: [p for p in run.pods(c) if p["spec"].get("activeDeadlineSeconds") == 1],
            f"the {component} pod given an active deadline",
        )
        run.cluster.finish_pod(run.namespace, pod["metadata"]["name"], 143)
    for job in ("exp-orchestrator", "exp-offload-gc"):
        failed = run.until(
            lambda j=job: next(
                (c for c in run.get("job", j)["status"].get("conditions", []) if c["type"] == "Failed"), None
            ),
            f"{job} Failed",
        )
        assert failed["status"] == "True", failed
        assert run.get("job", job)["spec"]["suspend"] is False
    # The stopped pods stay (with their logs), none replaces them, the engines are released.
    assert [p["status"]["phase"] for p in run.pods("orchestrator")] == ["Failed"]
    assert [p["status"]["phase"] for p in run.pods("offload-gc")] == ["Failed"]
    run.until(lambda: not run.pods("engine"), "the engine pods gone")
    assert run.get("statefulset", "exp-engine")["spec"]["replicas"] == 0


@pytest.mark.parametrize(("exit_code", "state"), [(0, "Succeeded"), (143, "Stopped")])
def test_a_succeeded_runs_surviving_pods_get_time_to_finish_and_keep_their_logs(
    run: Run, exit_code: int, state: str
) -> None:
    """The trainer ends before the orchestrator, which still tells the engines about the last checkpoint: the
    run is Succeeded, and the orchestrator's pod, rather than deleted with a suspended Job (its logs gone,
    its last sync cut), gets FINISH_GRACE_SECONDS more to end on its own (exit 0), after which its kubelet
    stops it (143 here, as kwok's fake kubelet cannot): the operator's doing, which fails nothing."""
    from rawmm_operator.status import FINISH_GRACE_SECONDS

    run.create(SPEC)
    run.wait_running()
    (trainer,) = run.running("trainer")
    run.cluster.finish_pod(run.namespace, trainer["metadata"]["name"], 0)
    run.until(lambda: run.status().get("phase") == "Succeeded", "phase Succeeded")
    (pod,) = run.until(
        lambda: [p for p in run.pods("orchestrator") if p["spec"].get("activeDeadlineSeconds")],
        "the orchestrator's pod given a deadline",
    )
    deadline = pod["spec"]["activeDeadlineSeconds"]
    assert FINISH_GRACE_SECONDS <= deadline <= FINISH_GRACE_SECONDS + 300, deadline  # its age so far, plus
    assert run.get("job", "exp-orchestrator")["spec"]["suspend"] is False
    run.cluster.finish_pod(run.namespace, pod["metadata"]["name"], exit_code)
    run.until(lambda: run.status().get("orchestrator", {}).get("state") == state, f"the orchestrator {state}")
    assert [p["metadata"]["name"] for p in run.pods("orchestrator")] == [pod["metadata"]["name"]]  # kept
    status = run.status()
    assert status["phase"] == "Succeeded"
    assert run.condition("Failed")["status"] == "False", status


def phase_changes(run: Run) -> list[str]:
    """The run's phase transitions, oldest first, as its events tell them ("Running -> Succeeded")."""
    events = sorted(run.events(), key=lambda e: e.get("firstTimestamp") or e["metadata"]["creationTimestamp"])
    return [
        e["message"].removeprefix("phase ").split(":")[0] for e in events if e["message"].startswith("phase ")
    ]


def test_a_role_is_running_only_when_its_pods_run_and_says_why_not_in_the_schedulers_words(run: Run) -> None:
    """A trainer pod no fake node can hold (16 GPUs; each has 8) is active for its Job but Pending: the run is
    not Running, and TrainerRunning carries the scheduler's own message."""
    run.create({**SPEC, "trainer": {**SPEC["trainer"], "gpusPerNode": 16}})
    run.until(lambda: run.pods("trainer"), "the trainer's pod")
    training = run.until(
        lambda: (
            run.condition("TrainerRunning")
            if run.condition("TrainerRunning").get("reason") == "Unschedulable"
            else None
        ),
        "TrainerRunning=False Unschedulable",
    )
    assert training["status"] == "False" and "Insufficient nvidia.com/gpu" in training["message"], training
    run.until(lambda: len(run.running("orchestrator")) == 1, "the orchestrator Running")
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 3, "three more passes")
    assert run.status()["phase"] == "Provisioning"
    assert not [change for change in phase_changes(run) if change.endswith("-> Running")]
    warnings = [e for e in run.events() if e["type"] == "Warning" and e["reason"] == "Unschedulable"]
    assert warnings and "Insufficient nvidia.com/gpu" in warnings[0]["message"]


def test_an_engine_that_cannot_pull_its_image_says_so_with_the_kubelets_message(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    pod = run.running("engine")[0]
    message = 'Back-off pulling image "registry.example/rawmm-inference:typo"'
    # What the kubelet reports for a container whose image cannot be pulled.
    run.set_pod_status(
        pod["metadata"]["name"],
        {
            "phase": "Pending",
            "conditions": [
                {"type": "Ready", "status": "False"},
                {"type": "ContainersReady", "status": "False"},
            ],
            "containerStatuses": [
                {
                    "name": pod["spec"]["containers"][0]["name"],
                    "image": pod["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": message}},
                }
            ],
        },
    )
    inference = run.until(
        lambda: (
            run.condition("InferenceReady")
            if run.condition("InferenceReady").get("reason") == "ImagePullBackOff"
            else None
        ),
        "InferenceReady=False ImagePullBackOff",
    )
    assert inference["status"] == "False" and message in inference["message"], inference
    assert pod["metadata"]["name"] in inference["message"]


def test_a_finished_run_goes_from_running_to_succeeded_without_provisioning(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    (trainer,) = run.running("trainer")
    run.cluster.finish_pod(run.namespace, trainer["metadata"]["name"], 0)
    run.until(lambda: run.status().get("phase") == "Succeeded", "phase Succeeded")
    changes = phase_changes(run)
    # Events carry whole seconds: two transitions within one second have no order, so no "last".
    assert "Running -> Succeeded" in changes, changes
    assert "Running -> Provisioning" not in changes and "Provisioning -> Succeeded" not in changes, changes


def test_jobs_the_operator_stops_after_a_failure_are_reported_as_stopped(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    (trainer,) = run.running("trainer")
    run.cluster.finish_pod(run.namespace, trainer["metadata"]["name"], 1)
    (pod,) = run.until(
        lambda: [p for p in run.pods("orchestrator") if p["spec"].get("activeDeadlineSeconds") == 1],
        "the orchestrator pod given an active deadline",
    )
    run.cluster.finish_pod(run.namespace, pod["metadata"]["name"], 143)
    # Neither queued (suspended by another controller) nor a failure of its own: the run's reason stays
    # the trainer's, and the orchestrator's Failed Job does not become the run's.
    orchestrating = run.until(
        lambda: (c := run.condition("OrchestratorRunning")) and c.get("reason") == "Stopped" and c,
        "OrchestratorRunning reason Stopped",
    )
    expected = "stopped by the operator: the run failed; its pods are kept for their logs"
    assert orchestrating["message"] == expected, orchestrating
    run.until(
        lambda: any(
            c["type"] == "Failed" for c in run.get("job", "exp-orchestrator")["status"].get("conditions", [])
        ),
        "the orchestrator Job Failed",
    )
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 2, "two more passes")
    assert run.status()["reason"] == "TrainerFailed"
    assert run.condition("Failed")["reason"] == "TrainerFailed"
    assert run.condition("OrchestratorRunning")["reason"] == "Stopped"


def test_a_queues_suspend_and_admission_are_never_overruled(run: Run) -> None:
    run.create(SPEC, labels={"kueue.x-k8s.io/queue-name": "team-a"})
    run.until(lambda: run.find("job", "exp-trainer") is not None, "the Jobs")
    for job in ("exp-orchestrator", "exp-trainer"):
        body = run.get("job", job)
        assert (
            body["spec"]["suspend"] is True
            and body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        )
    assert not run.pods("trainer")
    # A queue admits the Jobs (as Kueue does): the operator leaves them running.
    for job in ("exp-orchestrator", "exp-trainer"):
        run.kubectl("patch", "job", job, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    run.until(lambda: len(run.running("trainer")) == 1, "the admitted trainer Running")
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 3, "three more passes")
    assert run.get("job", "exp-trainer")["spec"]["suspend"] is False
    # The queue preempts the run: the operator leaves it suspended too.
    run.kubectl("patch", "job", "exp-trainer", "--type=merge", "-p", '{"spec": {"suspend": true}}')
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 3, "three more passes")
    assert run.get("job", "exp-trainer")["spec"]["suspend"] is True
    # The run's own suspend still reaches the Jobs.
    run.patch({"suspend": True})
    run.until(lambda: run.get("job", "exp-orchestrator")["spec"]["suspend"] is True, "the run's suspend")
    # Resumed, a queued run's Jobs wait for the queue's admission again: the operator does not admit them.
    run.patch({"suspend": False})
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 3, "three more passes")
    assert [run.get("job", job)["spec"]["suspend"] for job in ("exp-orchestrator", "exp-trainer")] == [
        True,
        True,
    ]


def test_events_are_posted_on_transitions_only(run: Run) -> None:
    run.create(SPEC)
    run.wait_running()
    run.until(lambda: run.events(), "the first events")

    def posted() -> list[tuple[str, int]]:
        return sorted((e["reason"], e.get("count") or 1) for e in run.events())

    before = posted()
    passes = run.operator.reconciles()
    run.until(lambda: run.operator.reconciles() >= passes + 5, "five more passes")
    assert posted() == before


def test_an_active_deadline_fails_the_run_and_stops_its_pods(run: Run) -> None:
    run.create({**SPEC, "activeDeadlineSeconds": 2})
    run.until(lambda: run.status().get("reason") == "DeadlineExceeded", "DeadlineExceeded")
    assert run.status()["phase"] == "Failed"
    # The engines are released; the Jobs' pods are stopped in place (an active deadline already past: kwok's
    # fake kubelet does not act on it, tests/kube/test_node_rlrun.py shows a real one stop them).
    run.until(
        lambda: (
            not run.pods("engine")
            and run.pods("trainer")
            and all(
                p["spec"].get("activeDeadlineSeconds") == 1
                for p in run.pods("trainer") + run.pods("orchestrator")
            )
        ),
        "its engines released and its other pods stopped",
    )


def test_a_ttl_deletes_a_finished_runs_children_but_keeps_the_run_and_its_volume(run: Run) -> None:
    run.create({**SPEC, "ttlSecondsAfterFinished": 0})
    run.wait_running()
    for component in ("orchestrator", "trainer"):
        (pod,) = run.running(component)
        run.cluster.finish_pod(run.namespace, pod["metadata"]["name"], 0)
    run.until(lambda: run.status().get("phase") == "Succeeded", "Succeeded", timeout=120)
    run.until(lambda: not run.children(), "every child but the volume deleted")
    assert run.find("secret", "exp-weights") is None
    assert run.find("pvc", "exp-offload") is not None
    assert run.status()["phase"] == "Succeeded"  # the RLRun stays


def gpu_pods_outside(run: Run) -> list[str]:
    """Pods of this module's other runs (namespaces op-N) that request GPUs and have not ended (an ended pod
    holds none), as namespace/name."""
    pods = json.loads(run.cluster.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
    return [
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        for pod in pods
        if pod["metadata"]["namespace"] != run.namespace
        and pod["metadata"]["namespace"].startswith("op-")
        and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        and any(
            "nvidia.com/gpu" in (c.get("resources", {}).get("requests") or {})
            for c in pod["spec"]["containers"]
        )
    ]


def test_a_read_write_once_volume_puts_every_pod_on_one_node(run: Run) -> None:
    """The real scheduler places the run's first pod anywhere and the others beside it (the fake nodes
    would otherwise spread them: three nodes, four pods). Earlier tests' pods must be gone: one still holding
    a node's GPUs leaves the first pod's node without room for the rest."""
    try:
        wait_for(lambda: not gpu_pods_outside(run), "earlier tests' GPU pods gone", TIMEOUT, 0.3)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {gpu_pods_outside(run)}") from None
    run.create({**SPEC, "offload": {**SPEC["offload"], "accessMode": "ReadWriteOnce"}})
    run.wait_running()
    pods = [p for component in ("engine", "orchestrator", "trainer") for p in run.running(component)]
    assert len(pods) == 4
    assert len({p["spec"]["nodeName"] for p in pods}) == 1, [p["spec"]["nodeName"] for p in pods]


def test_a_run_carries_no_finalizer_and_deletes_at_once(run: Run) -> None:
    """`kubectl delete rlrun` must never wait for an operator (uninstalled, or stopped)."""
    run.create(SPEC)
    run.until(lambda: run.status().get("phase"), "a status")
    assert not run.get("rlrun", run.name)["metadata"].get("finalizers")
    run.kubectl("delete", "rlrun", run.name, "--wait=true", "--timeout=20s")
    run.until(lambda: not run.children(), "its children collected")


def test_child_watches_are_filtered_by_the_run_label_on_the_server(
    kube_cluster: KubeCluster, operator: Operator
) -> None:
    """kopf lists (then watches) every child kind cluster-wide: with a label selector, so the server sends
    only the runs' children. (Watches reach the audit log when they end; their lists at once.)"""
    plurals = {"jobs": "/apis/batch/v1/jobs", "statefulsets": "/apis/apps/v1/statefulsets"}
    plurals["persistentvolumeclaims"] = "/api/v1/persistentvolumeclaims"
    requests = [
        e["requestURI"]
        for e in operator.audit_events(kube_cluster)
        if e["verb"] in ("list", "watch") and (e.get("objectRef") or {}).get("resource") in plurals
    ]
    for plural, path in plurals.items():
        cluster_wide = [uri for uri in requests if uri.split("?")[0] == path]
        assert cluster_wide, f"no cluster-wide list of {plural}: {requests}"
    for uri in requests:
        (selector,) = parse_qs(urlsplit(uri).query)["labelSelector"]
        assert selector.startswith(RUN_LABEL), uri


def test_the_deletions_were_made_as_the_charts_account_and_never_refused(
    kube_cluster: KubeCluster, operator: Operator
) -> None:
    """The delete grants test_real_lifecycle.py cannot observe in its scenario are used here (prune, Job
    replacement, expiry), and no request of the operator was refused."""
    events = operator.audit_events(kube_cluster)
    # RBAC's verdict (a 403 for an event posted into a namespace being deleted is no missing grant)
    denied = sorted(
        {
            (e["verb"], e["requestURI"])
            for e in events
            if e.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"
        }
    )
    assert not denied, denied
    deleted = {
        (ref.get("apiGroup", ""), ref["resource"])
        for e in events
        if e["verb"] == "delete" and (ref := e.get("objectRef"))
    }
    assert {
        ("", "services"),
        ("", "secrets"),
        ("", "configmaps"),
        ("apps", "statefulsets"),
        ("batch", "jobs"),
        ("monitoring.coreos.com", "podmonitors"),
    } <= deleted, deleted
