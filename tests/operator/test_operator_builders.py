from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_samples import CPU_ONLY, EXISTING_CLAIM, ISSUE_EXAMPLE, MULTI_GPU, MULTI_NODE, SPECS, merged

from rawmm.config import RunConfig
from rawmm.config.quantity import parse_byte_size
from rawmm.config.serve_argv import serve_argv
from rawmm_operator.catalogue import build_children
from rawmm_operator.children.config import build_weights_secret
from rawmm_operator.children.monitoring import PodMonitorSettings
from rawmm_operator.objects import RUN_LABEL, RunRef
from rawmm_operator.pods import TEMPLATE_HASH, container_resources
from rawmm_operator.spec import ENGINE_PORT, Resources, default_image, parse_spec, run_config

RUN = RunRef(name="exp", namespace="ml", uid="5b1f5d0e-6a37-4f8e-8a0d-4bd0c3b3b5a1")
KUBERNETES_VERSIONS = ["1.31", kubernetes_validate.latest_version()]


def children(spec: dict[str, Any], **kwargs: Any) -> dict[tuple[str, str], dict[str, Any]]:
    built = build_children(RUN, parse_spec(RUN.name, spec), **kwargs)
    by_key = {(m["kind"], m["metadata"]["name"]): m for m in built}
    assert len(by_key) == len(built), "two children share a kind and name"
    return by_key


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]


def all_pod_specs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [pod_spec(m) for m in children(spec).values() if m["kind"] in ("StatefulSet", "Job")]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_child_validates_strictly(name: str, version: str) -> None:
    validated = 0
    for manifest in children(SPECS[name]).values():
        if manifest["kind"] == "PodMonitor":
            continue  # a Prometheus Operator CRD: checked in test_pod_monitor below
        kubernetes_validate.validate(manifest, version, strict=True)
        validated += 1
    assert validated >= 6


def test_children_are_labelled_and_owned_by_the_run() -> None:
    for (kind, name), manifest in children(ISSUE_EXAMPLE).items():
        meta = manifest["metadata"]
        assert name.startswith("exp"), name
        assert meta["namespace"] == "ml"
        assert meta["labels"][RUN_LABEL] == "exp"
        if kind == "PersistentVolumeClaim":
            assert "ownerReferences" not in meta  # retainOnDelete: survives the run
            continue
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "rawmm.dev/v1alpha1",
            "kind": "RLRun",
            "name": "exp",
            "uid": RUN.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_claim_is_owned_when_not_retained_and_absent_when_brought() -> None:
    owned = children(CPU_ONLY)[("PersistentVolumeClaim", "exp-offload")]
    assert owned["metadata"]["ownerReferences"][0]["uid"] == RUN.uid
    assert owned["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "5Gi"}}}
    brought = children(EXISTING_CLAIM)
    assert not [key for key in brought if key[0] == "PersistentVolumeClaim"]
    for pod in all_pod_specs(EXISTING_CLAIM):
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "team-shared-rwx"}} in pod["volumes"]


def test_issue_example_claim_uses_its_storage_class() -> None:
    claim = children(ISSUE_EXAMPLE)[("PersistentVolumeClaim", "exp-offload")]
    assert claim["spec"]["storageClassName"] == "nfs-client"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    # "" is "no class" (a pre-provisioned volume), passed on as such; absent means the default class
    static = children(merged(ISSUE_EXAMPLE, {"offload": {"storageClassName": ""}}))
    assert static[("PersistentVolumeClaim", "exp-offload")]["spec"]["storageClassName"] == ""
    assert "storageClassName" not in children(CPU_ONLY)[("PersistentVolumeClaim", "exp-offload")]["spec"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_pod_mounts_the_shared_volume_at_the_same_path_and_is_locked_down(name: str) -> None:
    for pod in all_pod_specs(SPECS[name]):
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert container["resources"]["requests"]["cpu"]
            assert container["resources"]["requests"]["memory"]


def test_engine_statefulset_serves_raw_refs_with_the_cache_budget() -> None:
    built = children(ISSUE_EXAMPLE)
    engines = built[("StatefulSet", "exp-engine")]
    assert engines["spec"]["replicas"] == 2
    assert engines["spec"]["serviceName"] == "exp-engine-headless"
    (container,) = pod_spec(engines)["containers"]
    args = container["args"]
    assert container["command"] == ["rawmm"] and args[0] == "serve"
    assert args[args.index("--engine") + 1] == "vllm"
    assert args[args.index("--model") + 1] == "Qwen/Qwen3-VL-4B-Instruct"
    # The run's own directory on the claim (spec.run_dir), made by the pod before the engine starts.
    assert args[args.index("--offload-root") + 1] == f"/shared/runs/exp/{RUN.uid}/images"
    (directories,) = pod_spec(engines)["initContainers"]
    assert directories["command"] == [
        "mkdir",
        "-p",
        *(f"/shared/runs/exp/{RUN.uid}/{d}" for d in ("images", "rollouts", "checkpoints")),
    ]
    assert (
        directories["image"] == container["image"]
        and "nvidia.com/gpu" not in directories["resources"]["limits"]
    )
    assert args[args.index("--processor-backend") + 1] == "torchvision"
    assert "--" not in args  # no vLLM arguments to pass on
    assert args[args.index("--materialize-cache-size") + 1] == "4Gi"
    resources = container["resources"]
    # 32Gi asked for the engine itself + the 4Gi cache budget; no memory limit, as the user set none
    assert parse_byte_size(resources["requests"]["memory"]) == (32 + 4) * 2**30
    assert "memory" not in resources["limits"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    headless = built[("Service", "exp-engine-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == engines["spec"]["selector"]["matchLabels"]
    assert pod_spec(engines).get("nodeSelector") is None


@pytest.mark.parametrize("name", sorted(SPECS))
def test_engines_run_the_command_line_rawmm_run_gives_its_replicas(name: str) -> None:
    """One builder for both: the pods' `rawmm serve` is `serve_argv` of the run config in the ConfigMap,
    only the address differs (`rawmm run` listens on loopback)."""
    built = children(SPECS[name])
    (engine,) = pod_spec(built[("StatefulSet", "exp-engine")])["containers"]
    config = RunConfig.from_mapping(yaml.safe_load(built[("ConfigMap", "exp-config")]["data"]["run.yaml"]))
    assert config == run_config(RUN.name, RUN.namespace, parse_spec(RUN.name, SPECS[name]), uid=RUN.uid)
    assert engine["args"] == serve_argv(config, host="0.0.0.0", port=ENGINE_PORT)
    assert "RAWMM_MATERIALIZE_CACHE_SIZE" not in {e["name"] for e in engine["env"]}  # a flag, as locally


def test_urls_in_the_config_map_name_the_statefulset_pods() -> None:
    built = children(MULTI_GPU)
    config = RunConfig.from_mapping(yaml.safe_load(built[("ConfigMap", "exp-config")]["data"]["run.yaml"]))
    engines = built[("StatefulSet", "exp-engine")]
    service = engines["spec"]["serviceName"]
    assert config.inference.urls == [f"http://exp-engine-{i}.{service}.ml.svc:8000" for i in range(3)]


def test_multi_gpu_engines_get_gpus_tensor_parallelism_and_scheduling() -> None:
    engines = children(MULTI_GPU)[("StatefulSet", "exp-engine")]
    pod = pod_spec(engines)
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    vllm_args = container["args"][container["args"].index("--") + 1 :]
    assert vllm_args == ["--tensor-parallel-size", "4", "--max-model-len", "32768"]
    assert pod["nodeSelector"] == MULTI_GPU["inference"]["nodeSelector"]
    assert pod["tolerations"] == MULTI_GPU["inference"]["tolerations"]
    assert pod["affinity"] == MULTI_GPU["inference"]["affinity"]


def test_cpu_only_run_has_no_gpus_and_a_memory_limit_with_the_cache() -> None:
    built = children(CPU_ONLY)
    for pod in all_pod_specs(CPU_ONLY):
        for container in pod["containers"]:
            for part in ("requests", "limits"):
                assert "nvidia.com/gpu" not in container["resources"].get(part, {})
    (engine,) = pod_spec(built[("StatefulSet", "exp-engine")])["containers"]
    assert engine["args"][engine["args"].index("--engine") + 1] == "transformers"
    assert parse_byte_size(engine["resources"]["limits"]["memory"]) == 3 * 2**30 + 256 * 2**20
    assert parse_byte_size(engine["resources"]["requests"]["memory"]) == 2 * 2**30 + 256 * 2**20
    (trainer,) = pod_spec(built[("Job", "exp-trainer")])["containers"]
    assert [trainer["command"][0], *trainer["args"]] == [
        "rawmm",
        "train",
        "/etc/rawmm/run.yaml",
    ]
    assert not [key for key in built if key[0] == "PodMonitor"]


def test_orchestrator_job_runs_the_config_from_the_config_map() -> None:
    built = children(ISSUE_EXAMPLE)
    job = built[("Job", "exp-orchestrator")]
    (container,) = pod_spec(job)["containers"]
    assert [*container["command"], *container["args"]] == [
        "rawmm",
        "orchestrate",
        "/etc/rawmm/run.yaml",
    ]
    assert {"name": "config", "mountPath": "/etc/rawmm", "readOnly": True} in container["volumeMounts"]
    assert {"name": "config", "configMap": {"name": "exp-config"}} in pod_spec(job)["volumes"]
    assert job["spec"]["backoffLimit"] == 2  # SIGKILLs only (podFailurePolicy)
    assert pod_spec(job)["restartPolicy"] == "Never"


def test_single_node_multi_gpu_trainer_runs_under_standalone_torchrun() -> None:
    trainer = children(ISSUE_EXAMPLE)[("Job", "exp-trainer")]
    (container,) = pod_spec(trainer)["containers"]
    assert container["command"] == ["torchrun"]
    assert "--standalone" in container["args"] and "--nproc-per-node=8" in container["args"]
    assert container["args"][-4:] == [
        "--no-python",
        "rawmm",
        "train",
        "/etc/rawmm/run.yaml",
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert trainer["spec"]["completionMode"] == "Indexed"


def test_multi_node_trainer_is_an_indexed_job_with_a_rendezvous_service() -> None:
    built = children(MULTI_NODE)
    trainer = built[("Job", "exp-trainer")]
    assert trainer["spec"]["completionMode"] == "Indexed"
    assert trainer["spec"]["completions"] == trainer["spec"]["parallelism"] == 4
    pod = pod_spec(trainer)
    service = built[("Service", "exp-trainer")]
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    args = container["args"]
    assert "--nnodes=4" in args and "--nproc-per-node=8" in args and "--node-rank=$(NODE_RANK)" in args
    assert "--master-addr=exp-trainer-0.exp-trainer.ml.svc" in args
    (rank,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert "job-completion-index" in rank["valueFrom"]["fieldRef"]["fieldPath"]
    assert service["spec"]["selector"] == {RUN_LABEL: "exp", "app.kubernetes.io/component": "trainer"}


def test_suspend_scales_engines_to_zero_and_suspends_the_jobs() -> None:
    built = children(merged(ISSUE_EXAMPLE, {"suspend": True}))
    assert built[("StatefulSet", "exp-engine")]["spec"]["replicas"] == 0
    assert built[("Job", "exp-orchestrator")]["spec"]["suspend"] is True
    assert built[("Job", "exp-trainer")]["spec"]["suspend"] is True


def test_finished_run_releases_engines_and_leaves_its_jobs_alone() -> None:
    built = children(ISSUE_EXAMPLE, stage="finished")
    assert built[("StatefulSet", "exp-engine")]["spec"]["replicas"] == 0
    assert not [key for key in built if key[0] == "Job"]


def test_expired_run_keeps_only_its_volume() -> None:
    assert set(children(ISSUE_EXAMPLE, stage="expired")) == {("PersistentVolumeClaim", "exp-offload")}
    assert children(EXISTING_CLAIM, stage="expired") == {}


def test_cache_size_change_changes_only_the_engine_template() -> None:
    before = children(ISSUE_EXAMPLE)
    after = children(merged(ISSUE_EXAMPLE, {"inference": {"materializeCacheSize": "8Gi"}}))
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {("StatefulSet", "exp-engine"), ("ConfigMap", "exp-config")}
    assert pod_spec(before[("StatefulSet", "exp-engine")]) != pod_spec(after[("StatefulSet", "exp-engine")])


def test_pod_monitor() -> None:
    settings = PodMonitorSettings(interval="30s", labels=(("release", "kube-prometheus-stack"),))
    monitor = children(ISSUE_EXAMPLE, pod_monitor=settings)[("PodMonitor", "exp")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"] == {"matchLabels": {RUN_LABEL: "exp"}}
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert {e["interval"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"30s"}
    # every scraped port name exists on the pods it selects
    pod_ports = {
        p["name"] for pod in all_pod_specs(ISSUE_EXAMPLE) for c in pod["containers"] for p in c["ports"]
    }
    assert ports <= pod_ports
    assert not [
        k
        for k in children(ISSUE_EXAMPLE, pod_monitor=PodMonitorSettings(enabled=False))
        if k[0] == "PodMonitor"
    ]


def test_building_twice_gives_the_same_manifests() -> None:
    assert children(MULTI_NODE) == children(MULTI_NODE)


@pytest.mark.parametrize(
    ("requests", "limits", "expected_request", "expected_limit"),
    [
        # request = the user's request (else their limit, as Kubernetes would default it) + the cache;
        # a limit only where the user set one, + the cache
        ({"memory": "1Gi"}, {}, 2 * 2**30, None),
        ({"memory": "1Gi"}, {"memory": "4Gi"}, 2 * 2**30, 5 * 2**30),
        ({}, {"memory": "4Gi"}, 5 * 2**30, 5 * 2**30),
        ({}, {}, 2**30, None),
    ],
)
def test_container_resources_add_the_extra_memory(
    requests: dict, limits: dict, expected_request: int, expected_limit: int | None
) -> None:
    out = container_resources(Resources(requests=requests, limits=limits), gpus=0, extra_memory_bytes=2**30)
    assert parse_byte_size(out["requests"]["memory"]) == expected_request
    limit = out.get("limits", {}).get("memory")
    assert (parse_byte_size(limit) if limit else None) == expected_limit


def test_trust_remote_code_reaches_the_engine() -> None:
    (engine,) = pod_spec(children(EXISTING_CLAIM)[("StatefulSet", "exp-engine")])["containers"]
    assert "--trust-remote-code" in engine["args"]
    (plain,) = pod_spec(children(ISSUE_EXAMPLE)[("StatefulSet", "exp-engine")])["containers"]
    assert "--trust-remote-code" not in plain["args"]


def test_images_are_resolved_from_the_operators_release_unless_given() -> None:
    images = {
        (kind, name): pod_spec(m)["containers"][0]["image"]
        for (kind, name), m in children(CPU_ONLY).items()
        if kind in ("StatefulSet", "Job")
    }
    assert images == {
        ("StatefulSet", "exp-engine"): default_image("inference"),
        ("Job", "exp-orchestrator"): default_image("trainer"),
        ("Job", "exp-trainer"): default_image("trainer"),
    }
    assert parse_spec("exp", CPU_ONLY).inference.image == ""  # nothing baked into the stored spec
    (engine,) = pod_spec(children(ISSUE_EXAMPLE)[("StatefulSet", "exp-engine")])["containers"]
    assert engine["image"] == "registry.example/rawmm-inference:dev"


def test_read_write_once_puts_every_pod_of_the_run_on_one_node() -> None:
    term = {"labelSelector": {"matchLabels": {RUN_LABEL: "exp"}}, "topologyKey": "kubernetes.io/hostname"}
    for pod in all_pod_specs(CPU_ONLY):  # ReadWriteOnce
        assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [term]
    rwo_multi_gpu = merged(MULTI_GPU, {"offload": {"accessMode": "ReadWriteOnce"}})
    engine = pod_spec(children(rwo_multi_gpu)[("StatefulSet", "exp-engine")])
    # the user's own affinity is kept beside it
    assert engine["affinity"]["podAntiAffinity"] == MULTI_GPU["inference"]["affinity"]["podAntiAffinity"]
    assert engine["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [term]
    for pod in all_pod_specs(ISSUE_EXAMPLE):  # ReadWriteMany: no co-location
        assert "podAffinity" not in pod.get("affinity", {})


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pods_bound_shared_memory_and_reown_the_volume_only_on_mismatch(name: str) -> None:
    for pod in all_pod_specs(SPECS[name]):
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    shm = merged(CPU_ONLY, {"trainer": {"shmSize": "8Gi"}})
    (dshm,) = [v for v in pod_spec(children(shm)[("Job", "exp-trainer")])["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["sizeLimit"] == "8Gi"


def test_startup_probe_budget_is_configurable() -> None:
    def budget(spec: dict[str, Any]) -> int:
        (engine,) = pod_spec(children(spec)[("StatefulSet", "exp-engine")])["containers"]
        probe = engine["startupProbe"]
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert budget(ISSUE_EXAMPLE) == 1800
    assert budget(merged(ISSUE_EXAMPLE, {"inference": {"startupTimeoutSeconds": 7200}})) == 7200


def test_accelerator_resource_name_is_configurable() -> None:
    spec = merged(
        MULTI_GPU,
        {
            "inference": {"acceleratorResource": "nvidia.com/mig-3g.40gb"},
            "trainer": {"acceleratorResource": "amd.com/gpu"},
        },
    )
    built = children(spec)
    (engine,) = pod_spec(built[("StatefulSet", "exp-engine")])["containers"]
    (trainer,) = pod_spec(built[("Job", "exp-trainer")])["containers"]
    assert engine["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": 4}
    assert trainer["resources"]["limits"] == {"amd.com/gpu": 8}
    assert "nvidia.com/gpu" not in str(engine["resources"]) + str(trainer["resources"])


OVERRIDES: dict[str, Any] = {
    "env": [{"name": "HF_HOME", "value": "/models/hf"}, {"name": "NCCL_DEBUG", "value": "INFO"}],
    "envFrom": [{"secretRef": {"name": "hf-token"}}],
    "labels": {"team": "vision", RUN_LABEL: "not-mine"},
    "annotations": {"example.com/owner": "vision"},
    "nodeSelector": {"pool": "a100"},
    "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "priorityClassName": "training-high",
    "schedulerName": "volcano",
    "runtimeClassName": "nvidia",
    "serviceAccountName": "vision-runner",
    "imagePullSecrets": [{"name": "regcred"}],
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "resources": {"requests": {"cpu": "3", "memory": "5Gi"}, "limits": {"memory": "6Gi"}},
}


@pytest.mark.parametrize(
    ("role", "kind", "name"),
    [
        ("inference", "StatefulSet", "exp-engine"),
        ("orchestrator", "Job", "exp-orchestrator"),
        ("trainer", "Job", "exp-trainer"),
    ],
)
def test_pod_template_overrides_per_role(role: str, kind: str, name: str) -> None:
    built = children(merged(ISSUE_EXAMPLE, {role: OVERRIDES}))
    manifest = built[(kind, name)]
    kubernetes_validate.validate(manifest, KUBERNETES_VERSIONS[-1], strict=True)
    template = manifest["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    assert template["metadata"]["labels"]["team"] == "vision"
    assert template["metadata"]["labels"][RUN_LABEL] == "exp"  # the operator's own labels win
    assert template["metadata"]["annotations"] == {"example.com/owner": "vision"}
    for field in (
        "nodeSelector",
        "tolerations",
        "topologySpreadConstraints",
        "priorityClassName",
        "schedulerName",
        "runtimeClassName",
        "serviceAccountName",
        "imagePullSecrets",
    ):
        assert pod[field] == OVERRIDES[field], field
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": "/models/hf"}  # replaces the operator's
    assert env["NCCL_DEBUG"]["value"] == "INFO" and "HOME" in env
    assert [e["name"] for e in container["env"]].count("HF_HOME") == 1
    assert container["envFrom"] == OVERRIDES["envFrom"]
    assert OVERRIDES["volumes"][0] in pod["volumes"] and {v["name"] for v in pod["volumes"]} >= {
        "shared",
        "dshm",
    }
    assert OVERRIDES["volumeMounts"][0] in container["volumeMounts"]
    assert container["resources"]["requests"]["cpu"] == "3"
    # the other roles are untouched
    others = [m for key, m in built.items() if key[0] in ("StatefulSet", "Job") and key != (kind, name)]
    for other in others:
        assert "priorityClassName" not in pod_spec(other)


def test_jobs_ignore_disruptions_retry_a_kill_and_fail_on_a_real_failure() -> None:
    for key in (("Job", "exp-orchestrator"), ("Job", "exp-trainer")):
        job = children(MULTI_NODE)[key]
        container = pod_spec(job)["containers"][0]["name"]
        assert job["spec"]["backoffLimit"] == 2  # SIGKILLs replaced; counted by nothing else
        assert job["spec"]["podFailurePolicy"]["rules"] == [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "Count",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [137]},
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "NotIn", "values": [0]},
            },
        ]
        assert job["spec"]["podReplacementPolicy"] == "Failed"
        assert pod_spec(job)["restartPolicy"] == "Never"  # podFailurePolicy requires it


def config_map_run_config(spec: dict[str, Any]) -> RunConfig:
    built = children(spec)
    return RunConfig.from_mapping(yaml.safe_load(built[("ConfigMap", "exp-config")]["data"]["run.yaml"]))


def test_both_waits_have_the_rlruns_deadlines_in_the_run_config() -> None:
    """The pods run with no timeout flag: `rawmm train` and `rawmm orchestrate` read both deadlines from the
    ConfigMap's run config."""
    default = config_map_run_config(ISSUE_EXAMPLE)
    assert (default.trainer.batch_timeout_seconds, default.orchestrator.checkpoint_timeout_seconds) == (
        7200,
        7200,
    )
    spec = merged(
        CPU_ONLY, {"trainer": {"batchTimeoutSeconds": 60}, "orchestrator": {"checkpointTimeoutSeconds": 90}}
    )
    config = config_map_run_config(spec)
    assert (config.trainer.batch_timeout_seconds, config.orchestrator.checkpoint_timeout_seconds) == (60, 90)


def test_queue_label_reaches_the_jobs_which_start_suspended() -> None:
    queued = RunRef(name="exp", namespace="ml", uid=RUN.uid, queue_name="team-a")
    built = build_children(queued, parse_spec("exp", ISSUE_EXAMPLE))
    jobs = [m for m in built if m["kind"] == "Job"]
    assert len(jobs) == 2
    for job in jobs:
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert job["spec"]["suspend"] is True  # Kueue admits it by unsuspending
    plain = [m for m in children(ISSUE_EXAMPLE).values() if m["kind"] == "Job"]
    assert all(job["spec"]["suspend"] is False for job in plain)
    assert all("kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"] for job in plain)


def job_hashes(spec: dict[str, Any]) -> dict[str, str]:
    return {
        name: m["metadata"]["annotations"][TEMPLATE_HASH]
        for (kind, name), m in children(spec).items()
        if kind == "Job"
    }


def test_template_hash_follows_what_each_job_runs() -> None:
    base = job_hashes(ISSUE_EXAMPLE)
    assert job_hashes(ISSUE_EXAMPLE) == base
    # suspend changes in place; the engines' cache is not what the Jobs run
    assert job_hashes(merged(ISSUE_EXAMPLE, {"suspend": True})) == base
    assert job_hashes(merged(ISSUE_EXAMPLE, {"inference": {"materializeCacheSize": "8Gi"}})) == base
    trainer_only = job_hashes(merged(ISSUE_EXAMPLE, {"trainer": {"resources": {"requests": {"cpu": "16"}}}}))
    assert trainer_only["exp-trainer"] != base["exp-trainer"]
    assert trainer_only["exp-orchestrator"] == base["exp-orchestrator"]
    # a run config change (read by both from the ConfigMap) and the engines' URLs
    for patch in ({"trainer": {"learningRate": 1e-5}}, {"inference": {"replicas": 3}}):
        changed = job_hashes(merged(ISSUE_EXAMPLE, patch))
        assert changed["exp-orchestrator"] != base["exp-orchestrator"], patch


def test_engines_and_orchestrator_get_the_weights_token_and_root() -> None:
    built = children(ISSUE_EXAMPLE)
    token = {
        "name": "RAWMM_WEIGHTS_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "exp-weights", "key": "token"}},
    }
    (engine,) = pod_spec(built[("StatefulSet", "exp-engine")])["containers"]
    (orchestrator,) = pod_spec(built[("Job", "exp-orchestrator")])["containers"]
    (trainer,) = pod_spec(built[("Job", "exp-trainer")])["containers"]
    assert token in engine["env"] and token in orchestrator["env"]
    assert token not in trainer["env"]
    assert (
        engine["args"][engine["args"].index("--weights-root") + 1]
        == f"/shared/runs/exp/{RUN.uid}/checkpoints"
    )
    secret = build_weights_secret(RUN, "s3cret")
    kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[-1], strict=True)
    assert secret["metadata"]["name"] == "exp-weights" and secret["stringData"] == {"token": "s3cret"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == RUN.uid


BROADCAST = merged(CPU_ONLY, {"trainer": {"weightTransfer": "broadcast", "checkpointEvery": 5}})
WEIGHTS_TOKEN = {
    "name": "RAWMM_WEIGHTS_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "exp-weights", "key": "token"}},
}
POD_IP = {"name": "RAWMM_WEIGHT_TRANSFER_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
WEIGHTS_PORT = {"name": "weights", "containerPort": 29501, "protocol": "TCP"}


def trainer_container(built: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_spec(built[("Job", "exp-trainer")])["containers"]
    return container


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_a_broadcasting_trainer_gets_the_token_its_rendezvous_and_the_engines(version: str) -> None:
    """What `rawmm.rl.trainer.weight_publish` reads: the weights token (rank 0 calls the engines' transfer
    routes), the rendezvous address (the pod's IP) and a fixed port, declared on the container."""
    from rawmm.rl.trainer.weight_publish import ADDRESS_ENV, PORT_ENV

    built = children(BROADCAST)
    trainer = built[("Job", "exp-trainer")]
    kubernetes_validate.validate(trainer, version, strict=True)
    container = trainer_container(built)
    env = {e["name"]: e for e in container["env"]}
    assert env["RAWMM_WEIGHTS_TOKEN"] == WEIGHTS_TOKEN
    assert env[ADDRESS_ENV] == POD_IP
    assert env[PORT_ENV] == {"name": PORT_ENV, "value": "29501"}
    assert WEIGHTS_PORT in container["ports"]
    # the engines' URLs and the mode reach the trainer through the run config it reads
    config = RunConfig.from_mapping(yaml.safe_load(built[("ConfigMap", "exp-config")]["data"]["run.yaml"]))
    assert (config.trainer.weight_transfer, config.trainer.checkpoint_every) == ("broadcast", 5)
    assert config.inference.urls == ["http://exp-engine-0.exp-engine-headless.ml.svc:8000"]
    # the engines are as in checkpoint mode: they already hold the token
    (engine,) = pod_spec(built[("StatefulSet", "exp-engine")])["containers"]
    assert WEIGHTS_TOKEN in engine["env"]


def test_a_checkpoint_trainer_gets_neither_token_nor_rendezvous() -> None:
    container = trainer_container(children(CPU_ONLY))
    names = {e["name"] for e in container["env"]}
    assert not names & {"RAWMM_WEIGHTS_TOKEN", "RAWMM_WEIGHT_TRANSFER_ADDRESS", "RAWMM_WEIGHT_TRANSFER_PORT"}
    assert [p["name"] for p in container["ports"]] == ["metrics"]


def test_a_broadcasting_multi_node_trainer_keeps_torchruns_rendezvous_apart() -> None:
    """Every trainer pod gets its own IP (only rank 0's listens); torchrun keeps its own port and Service."""
    spec = merged(
        MULTI_NODE,
        {
            "inference": {"engine": "transformers", "tensorParallelSize": 1},
            "trainer": {"weightTransfer": "broadcast"},
        },
    )
    built = children(spec)
    container = trainer_container(built)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9102, "rendezvous": 29500, "weights": 29501}
    assert POD_IP in container["env"] and WEIGHTS_TOKEN in container["env"]
    service = built[("Service", "exp-trainer")]
    assert [p["name"] for p in service["spec"]["ports"]] == ["rendezvous"]
    kubernetes_validate.validate(built[("Job", "exp-trainer")], KUBERNETES_VERSIONS[-1], strict=True)


def test_a_trainer_env_entry_replaces_the_operators_rendezvous_address() -> None:
    """A cluster whose engines cannot reach the pod IP (another network for the trainer) names its own."""
    address = {"name": "RAWMM_WEIGHT_TRANSFER_ADDRESS", "value": "10.1.2.3"}
    container = trainer_container(children(merged(BROADCAST, {"trainer": {"env": [address]}})))
    assert [e for e in container["env"] if e["name"] == address["name"]] == [address]
