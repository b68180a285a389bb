"""The RLRun spec: camelCase models derived from `rawmm.config`, plus the Kubernetes-only settings.

Each RL section subclasses its run-config model, so the hyperparameters, their defaults and their
ranges have one definition; the operator turns a validated spec back into a `RunConfig`
(`run_config`) for the pods. Cross-field rules are declared once (`Rule`): the CRD carries them as CEL
so the API server rejects a bad spec, and the same check runs here so the operator reports one that
reached it anyway (an older CRD, a server without CEL).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

import rawmm
from rawmm.config import (
    BUILTIN_ENVIRONMENTS,
    ENVIRONMENT_REFERENCE_PATTERN,
    MIN_TEMPERATURE,
    EnvironmentConfig,
    InferenceConfig,
    InferenceSettings,
    ModelConfig,
    ModelSettings,
    MonitoringConfig,
    OffloadConfig,
    OrchestratorConfig,
    RetentionConfig,
    RunConfig,
    SamplingConfig,
    StrictModel,
    TrainerConfig,
    environment_name_problem,
    format_validation_error,
    temperature_problem,
)
from rawmm.config.quantity import BYTE_SIZE_PATTERN, parse_byte_size
from rawmm_operator.names import child_name, engine_pod

API_GROUP = "rawmm.dev"
API_VERSION = "v1alpha1"
KIND = "RLRun"
PLURAL = "rlruns"

# Every pod mounts the run's volume here, so a file:// URI or checkpoint path written by one pod
# resolves in every other pod.
SHARED_MOUNT = PurePosixPath("/shared")
RUN_CONFIG_DIR = PurePosixPath("/etc/rawmm")
RUN_CONFIG_FILE = "run.yaml"
ENGINE_PORT = 8000
# Children get names like `<run>-engine-headless` (`names.py`; a DNS-1035 label, 63 characters at most)
# and pods `<run>-trainer-<index>-<suffix>`; the run name leaves room for those.
MAX_RUN_NAME = 40
RUN_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_RUN_NAME = re.compile(RUN_NAME_PATTERN)


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name an RLRun's children, or None. (The CRD's schema checks the same; this
    catches an RLRun stored under an older CRD.)"""
    if len(name) > MAX_RUN_NAME:
        return f"the RLRun name must be at most {MAX_RUN_NAME} characters (its children's names extend it)"
    if not _RUN_NAME.match(name):
        return (
            "the RLRun name must be a DNS-1035 label (lowercase letters, digits, '-'; starts with a letter)"
        )
    return None


def default_image(component: Literal["operator", "inference", "trainer"]) -> str:
    """The image of this operator's own release, for a role whose `image` is empty. Resolved at
    reconcile time, never stored as a CRD default, so upgrading the operator moves such runs along.
    RAWMM_IMAGE_REGISTRY and RAWMM_IMAGE_TAG (the chart's runs.images) point every run at your builds."""
    registry = os.environ.get("RAWMM_IMAGE_REGISTRY") or "ghcr.io/rawmm"
    return (
        f"{registry.rstrip('/')}/rawmm-{component}:{os.environ.get('RAWMM_IMAGE_TAG') or rawmm.__version__}"
    )


def _as_in(config: type[BaseModel], name: str, **field: Any) -> Any:
    """A spec field that narrows the run config's field `name` (another default, a tighter bound) and keeps
    its description: the config is the one place a hyperparameter is explained."""
    return Field(description=config.model_fields[name].description, **field)


def _image() -> Any:
    return Field(
        default="", description="empty: the image of the operator's release, resolved at reconcile time"
    )


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: `cel` for the API server (None where CEL cannot say it cheaply), `holds` for
    the operator, one message for both. A rule must hold on the object as the server stores it: a field
    without a schema default may be absent, so `cel` guards it with has()."""

    cel: str | None
    message: str
    holds: Callable[[Any], bool]


def _is_byte_size(value: int | str) -> bool:
    try:
        parse_byte_size(value)
    except ValueError:
        return False
    return True


def _memory_is_a_byte_size(part: str) -> Callable[[Any], bool]:
    """The rule check that `resources.<part>.memory` (requests or limits) is a plain byte size."""
    return lambda spec: _is_byte_size(getattr(spec.resources, part).get("memory", 0))


def _schema_extra(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    transitions: tuple[dict[str, str], ...] = getattr(cls, "transition_rules", ())
    validations = [{"rule": r.cel, "message": r.message} for r in rules if r.cel] + list(transitions)
    if validations:
        schema["x-kubernetes-validations"] = validations


CAMEL = ConfigDict(alias_generator=to_camel, json_schema_extra=_schema_extra)


def immutable(what: str) -> dict[str, Any]:
    """CEL transition rule for a field that may not change after creation."""
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{what} is immutable"}]}


def _immutable_optional(field: str) -> dict[str, str]:
    return {
        "rule": f"has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})",
        "message": f"{field} is immutable",
    }


class SpecModel(StrictModel):
    model_config = CAMEL
    rules: ClassVar[tuple[Rule, ...]] = ()
    transition_rules: ClassVar[tuple[dict[str, str], ...]] = ()  # CEL on updates only (oldSelf)

    @model_validator(mode="after")
    def _rules_hold(self) -> SpecModel:
        for rule in self.rules:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self


class Resources(SpecModel):
    """Kubernetes resource requests and limits (quantities)."""

    requests: dict[str, int | str] = Field(
        default_factory=dict, description="what the scheduler reserves, e.g. {cpu: 8, memory: 64Gi}"
    )
    limits: dict[str, int | str] = Field(
        default_factory=dict, description="what the container may use at most (memory over it: OOMKilled)"
    )


def default_resources(description: str = "", **requests: str) -> Any:
    """A `resources` field whose default requests also appear in the CRD (the server stores them)."""
    return Field(
        default_factory=lambda: Resources(requests=dict(requests)),
        description=description or None,
        json_schema_extra={"default": {"requests": dict(requests)}},
    )


# The trainer pods' torchrun rendezvous port (several nodes): no other container port may take it.
TORCHRUN_PORT = 29500
# With `trainer.weightTransfer: broadcast`, the rendezvous rank 0 opens for the engines (its TCPStore), on
# every trainer pod's `weights` port: the engine pods must reach it (docs/running-on-a-gpu-cluster.md).
WEIGHT_TRANSFER_PORT = 29501
# What the operator mounts in every pod: user volumes and mounts may not reuse these.
RESERVED_VOLUMES = frozenset({"shared", "tmp", "dshm", "config"})
RESERVED_MOUNT_PATHS = frozenset({str(SHARED_MOUNT), "/tmp", "/dev/shm", str(RUN_CONFIG_DIR)})
# A Kubernetes extended resource name (`nvidia.com/gpu`, `amd.com/gpu`, `nvidia.com/mig-1g.10gb`).
# The domain is required: the API server refuses an unprefixed name that is not one of its own (cpu, memory).
RESOURCE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
Objects = list[dict[str, Any]]


def _free_names(items: Objects, key: str, reserved: frozenset[str]) -> bool:
    return not any(_normalized(item.get(key), key) in reserved for item in items)


def _normalized(value: Any, key: str) -> Any:
    # `/shared/` and `/shared//` are `/shared`: the kubelet mounts them all at the same place.
    return posixpath.normpath(value) if key == "mountPath" and isinstance(value, str) and value else value


def _distinct_in(field: str, key: str) -> Callable[[Any], bool]:
    """Whether no two items of a role's ``field`` share ``key``: server-side apply cannot even build a patch
    from such a list (its list-map keys), and answers with a 500 that would look transient."""

    def holds(settings: Any) -> bool:
        values = [repr(_normalized(item.get(key), key)) for item in getattr(settings, field)]
        return len(values) == len(set(values))

    return holds


class PodSettings(SpecModel):
    """Per-role pod template settings (KubeRay / Kubeflow Trainer style), merged into what the operator
    builds: env, labels and annotations are added (the operator's own labels win), lists are appended,
    the rest set the pod spec field of the same name."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=None,
            message=f"volumes may not be named {', '.join(sorted(RESERVED_VOLUMES))} (the operator's own)",
            holds=lambda s: _free_names(s.volumes, "name", RESERVED_VOLUMES),
        ),
        Rule(
            cel=None,
            message=f"volumeMounts may not mount at {', '.join(sorted(RESERVED_MOUNT_PATHS))} (the operator's own)",
            holds=lambda s: _free_names(s.volume_mounts, "mountPath", RESERVED_MOUNT_PATHS),
        ),
        *(
            Rule(
                cel=None,
                message=f"two {field} share a {key}",
                holds=_distinct_in(attr, key),
            )
            for field, attr, key in (
                ("env entries", "env", "name"),
                ("volumes", "volumes", "name"),
                ("volumeMounts", "volume_mounts", "mountPath"),
            )
        ),
    )

    env: Objects = Field(
        default_factory=list, description="EnvVar list; replaces an operator variable of the same name"
    )
    env_from: Objects = Field(
        default_factory=list, description="EnvFromSource list, e.g. [{secretRef: {name: hf-token}}]"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="pod labels (the operator's own win)")
    annotations: dict[str, str] = Field(default_factory=dict, description="pod annotations")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="node labels the role's pods need, e.g. {nvidia.com/gpu.present: 'true'}",
    )
    tolerations: Objects = Field(
        default_factory=list, description="Toleration list, e.g. for tainted GPU nodes"
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict, description="the pod's Affinity (the operator adds its own for ReadWriteOnce)"
    )
    topology_spread_constraints: Objects = Field(
        default_factory=list, description="TopologySpreadConstraint list"
    )
    priority_class_name: str | None = Field(default=None, description="the pods' PriorityClass")
    scheduler_name: str | None = Field(
        default=None, description="another scheduler for the role's pods (e.g. a gang scheduler)"
    )
    runtime_class_name: str | None = Field(default=None, description="the pods' RuntimeClass, e.g. nvidia")
    service_account_name: str | None = Field(
        default=None, description="the pods' ServiceAccount (default: the namespace's default account)"
    )
    image_pull_secrets: Objects = Field(default_factory=list, description="e.g. [{name: regcred}]")
    volumes: Objects = Field(default_factory=list, description="extra pod volumes")
    volume_mounts: Objects = Field(default_factory=list, description="extra mounts of the role's container")
    shm_size: str = Field(
        default="1Gi",
        pattern=BYTE_SIZE_PATTERN,
        max_length=32,
        description="sizeLimit of /dev/shm (a memory emptyDir: it counts against the memory limit)",
    )


class ModelSpec(ModelSettings):
    model_config = CAMEL
    name: str = Field(
        min_length=1, description="hub id, or a checkpoint directory under the run's shared volume"
    )


# A claim or storage class name: a DNS-1123 subdomain (the schema bounds it, so no CEL is needed).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class RetentionSpec(PodSettings, RetentionConfig):
    """Garbage collection of the offload volume: when enabled, a `<run>-offload-gc` Job runs
    `rawmm gc --watch` beside the trainer (a pass per checkpoint) and reports the volume's usage."""

    model_config = CAMEL
    image: str = _image()
    # The run config's 0 (no /metrics) is no port a pod can declare.
    metrics_port: int = Field(default=9103, ge=1, le=65535, description="/metrics of the GC process")
    resources: Resources = default_resources(cpu="250m", memory="512Mi")


class OffloadSpec(SpecModel):
    """The run's shared volume: offloaded images, rollout batches and checkpoints."""

    rules = (
        Rule(
            cel="quantity(self.size).compareTo(quantity('0')) > 0",
            message="offload.size must be more than 0",
            holds=lambda s: parse_byte_size(s.size) > 0,
        ),
    )

    transition_rules = (
        *(_immutable_optional(field) for field in ("existingClaim", "storageClassName", "accessMode")),
        {
            # A claim can grow (where its class allows expansion) but never shrink: the server answers 422.
            "rule": "quantity(self.size).compareTo(quantity(oldSelf.size)) >= 0",
            "message": "offload.size cannot shrink",
        },
    )

    size: str = Field(
        default="100Gi",
        pattern=BYTE_SIZE_PATTERN,
        max_length=32,
        description="may grow where the storage class allows volume expansion; never shrink",
    )
    storage_class_name: str | None = Field(
        default=None,
        # "" is Kubernetes' "no class": bind a pre-provisioned volume, never the default class.
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
        max_length=253,
        description='empty: the cluster\'s default class; "": no class (a pre-provisioned volume)',
    )
    # ReadWriteOncePod cannot work: engine, orchestrator and trainer pods all mount the claim.
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany",
        description="ReadWriteOnce puts every pod of the run on one node (required pod affinity); "
        "set it to the existing claim's mode when existingClaim is used",
    )
    existing_claim: str | None = Field(
        default=None,
        description="use this PVC instead of creating one",
        pattern=DNS_SUBDOMAIN,
        max_length=253,
    )
    retain_on_delete: bool = Field(default=True, description="keep the created PVC when the RLRun is deleted")
    retention: RetentionSpec = Field(default_factory=RetentionSpec)


class InferenceSpec(PodSettings, InferenceSettings):
    model_config = CAMEL
    rules = (
        *PodSettings.rules,
        # The default inference image is vLLM's CUDA build; vLLM on CPUs runs from an image of its CPU build
        # (docs/cluster.md: the CPU inference image), which the run names.
        Rule(
            cel="self.engine != 'vllm' || self.gpus >= 1 || (has(self.image) && self.image != '')",
            message="the vllm engine needs gpus >= 1, or an image of vLLM's CPU build in inference.image "
            "(use engine: transformers for CPU-only engines)",
            holds=lambda s: s.engine != "vllm" or s.gpus >= 1 or bool(s.image),
        ),
        Rule(
            # extraArgs has no schema default: absent on the stored object unless the user wrote it.
            cel="self.engine == 'vllm' || (self.tensorParallelSize == 1 && (!has(self.extraArgs) || size(self.extraArgs) == 0))",
            message="tensorParallelSize > 1 and extraArgs are vLLM arguments: they need engine: vllm",
            holds=lambda s: s.engine == "vllm" or (s.tensor_parallel_size == 1 and not s.extra_args),
        ),
        Rule(
            cel="self.tensorParallelSize <= (self.gpus > 0 ? self.gpus : 1)",
            message="tensorParallelSize cannot exceed the GPUs of one replica",
            holds=lambda s: s.tensor_parallel_size <= max(s.gpus, 1),
        ),
        *(
            Rule(
                # The operator adds the cache budget to these, so they must be plain byte sizes. Checked by
                # the operator only: a regex over unbounded map values would blow CEL's cost budget.
                cel=None,
                message=f"resources.{part}.memory must be bytes or a quantity such as 16Gi",
                holds=_memory_is_a_byte_size(part),
            )
            for part in ("requests", "limits")
        ),
    )

    engine: Literal["transformers", "vllm"] = _as_in(InferenceSettings, "engine", default="vllm")
    image: str = _image()
    gpus: int = Field(default=1, ge=0, description="accelerators per engine replica")
    accelerator_resource: str = Field(
        default="nvidia.com/gpu",
        pattern=RESOURCE_NAME_PATTERN,
        max_length=253,
        description="the extended resource `gpus` counts: nvidia.com/gpu, amd.com/gpu, a MIG profile",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM's --tensor-parallel-size: GPUs of one replica that share the model"
    )
    resources: Resources = default_resources(
        "per replica; the operator adds materializeCacheSize to the memory request (and to the limit, if set)",
        cpu="4",
        memory="16Gi",
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=60,
        description="how long an engine may take to load its model before it is restarted",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="extra vLLM server arguments (after `--` of `rawmm serve`)"
    )


class EnvironmentSpec(SpecModel, EnvironmentConfig):
    model_config = CAMEL
    # The run config's check of the name, as CEL: kubectl apply refuses an environment the orchestrator
    # could never load (a user's module is only checked for its form: it lives in the orchestrator's image).
    rules = (
        Rule(
            cel=f"self.name in {list(BUILTIN_ENVIRONMENTS)} || self.name.matches('{ENVIRONMENT_REFERENCE_PATTERN}')",
            message=f"orchestrator.environment.name must be one of {', '.join(BUILTIN_ENVIRONMENTS)} "
            "or 'package.module:Class'",
            holds=lambda s: environment_name_problem(s.name) is None,
        ),
    )


class SamplingSpec(SpecModel, SamplingConfig):
    model_config = CAMEL
    # The run config's own checks of these fields (its validators hold the Python side), as CEL: the API
    # server refuses such an RLRun at creation instead of the operator marking it invalid.
    rules = (
        Rule(
            cel=f"self.temperature == 0.0 || self.temperature >= {MIN_TEMPERATURE}",
            message=f"sampling.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}",
            holds=lambda s: temperature_problem(s.temperature) is None,
        ),
        Rule(
            cel="self.topP == 1.0",
            message="sampling.topP must be 1.0: the trainer scores tokens under the full distribution",
            holds=lambda s: s.top_p == 1.0,
        ),
    )


class OrchestratorSpec(PodSettings, OrchestratorConfig):
    model_config = CAMEL
    environment: EnvironmentSpec = _as_in(OrchestratorConfig, "environment", default_factory=EnvironmentSpec)
    sampling: SamplingSpec = _as_in(OrchestratorConfig, "sampling", default_factory=SamplingSpec)
    image: str = _image()
    resources: Resources = default_resources(cpu="2", memory="4Gi")


class TrainerSpec(PodSettings, TrainerConfig):
    model_config = CAMEL
    # TrainerConfig checks this too; the CEL copy lets the API server refuse such an RLRun at creation.
    rules = (
        *PodSettings.rules,
        Rule(
            cel="self.seqLen <= self.microBatchTokens",
            message="seqLen must not exceed microBatchTokens: a truncated sample has to fit in one micro-batch",
            holds=lambda s: s.seq_len <= s.micro_batch_tokens,
        ),
        Rule(
            cel="self.checkpointEvery == 1 || self.weightTransfer == 'broadcast'",
            message="checkpointEvery above 1 needs weightTransfer broadcast: in checkpoint mode every step's "
            "weights reach the engines by its checkpoint",
            holds=lambda s: s.checkpoint_every == 1 or s.weight_transfer == "broadcast",
        ),
    )
    image: str = _image()
    nodes: int = Field(
        default=1, ge=1, description="trainer pods, one per node (an indexed Job; torchrun across them)"
    )
    gpus_per_node: int = Field(
        default=1, ge=0, description="accelerators per trainer pod; torchrun starts one rank per GPU"
    )
    accelerator_resource: str = Field(
        default="nvidia.com/gpu",
        pattern=RESOURCE_NAME_PATTERN,
        max_length=253,
        description="the extended resource `gpusPerNode` counts",
    )
    resources: Resources = default_resources("per node", cpu="8", memory="64Gi")

    @property
    def distributed(self) -> bool:
        return self.nodes > 1 or self.gpus_per_node > 1


class MonitoringSpec(MonitoringConfig):
    model_config = CAMEL
    orchestrator_metrics_port: int = _as_in(
        MonitoringConfig, "orchestrator_metrics_port", default=9101, ge=1, le=65535
    )
    trainer_metrics_port: int = _as_in(MonitoringConfig, "trainer_metrics_port", default=9102, ge=1, le=65535)
    pod_monitor: bool = Field(default=True, description="create a Prometheus Operator PodMonitor for the run")


# trainer.weightTransfer has a schema default; has() keeps the rules safe on an object without it all the same.
_NOT_BROADCAST = "!has(self.trainer.weightTransfer) || self.trainer.weightTransfer != 'broadcast'"


class RLRunSpec(SpecModel):
    rules = (
        Rule(
            # offload and trainer have schema defaults ({}), so both are present on the stored object.
            cel="self.offload.accessMode != 'ReadWriteOnce' || self.trainer.nodes == 1",
            message="offload.accessMode ReadWriteOnce keeps every pod on one node: it needs trainer.nodes 1",
            holds=lambda s: s.offload.access_mode != "ReadWriteOnce" or s.trainer.nodes == 1,
        ),
        Rule(
            cel=f"self.monitoring.trainerMetricsPort != {TORCHRUN_PORT}",
            message=f"monitoring.trainerMetricsPort {TORCHRUN_PORT} is torchrun's rendezvous port in the trainer pods",
            holds=lambda s: s.monitoring.trainer_metrics_port != TORCHRUN_PORT,
        ),
        # vLLM's side of the broadcast receives into one worker per replica; the run config refuses a
        # tensorParallelSize above 1 in the derived vLLM arguments too (RunConfig, when the operator derives
        # it): the CEL copy lets the API server refuse such an RLRun at creation. inference has a schema
        # default, so its engine and tensorParallelSize are always stored.
        Rule(
            cel=f"{_NOT_BROADCAST} || self.inference.engine != 'vllm' || self.inference.tensorParallelSize == 1",
            message="trainer.weightTransfer broadcast with inference.engine vllm needs inference.tensorParallelSize "
            "1: the broadcast reaches one worker per replica (use weightTransfer checkpoint)",
            holds=lambda s: (
                s.trainer.weight_transfer != "broadcast"
                or s.inference.engine != "vllm"
                or s.inference.tensor_parallel_size == 1
            ),
        ),
        Rule(
            cel=f"{_NOT_BROADCAST} || self.monitoring.trainerMetricsPort != {WEIGHT_TRANSFER_PORT}",
            message=f"monitoring.trainerMetricsPort {WEIGHT_TRANSFER_PORT} is the weight broadcast's "
            "rendezvous port in the trainer pods (trainer.weightTransfer broadcast)",
            holds=lambda s: (
                s.trainer.weight_transfer != "broadcast"
                or s.monitoring.trainer_metrics_port != WEIGHT_TRANSFER_PORT
            ),
        ),
    )

    model: ModelSpec = Field(
        json_schema_extra=immutable("model"),
        description="the policy model: checkpoint, image layout preset and processor backend (immutable)",
    )
    offload: OffloadSpec = Field(
        default_factory=OffloadSpec,
        description="the run's shared volume (/shared in every pod): images, rollout batches, checkpoints",
    )
    inference: InferenceSpec = Field(
        default_factory=InferenceSpec,
        description="the engine replicas (a StatefulSet): they sample rollouts and load each checkpoint",
    )
    orchestrator: OrchestratorSpec = Field(
        default_factory=OrchestratorSpec,
        description="the orchestrator Job: plays the environment against the engines, writes rollout batches",
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec,
        description="the trainer Job: trains on each rollout batch and writes the checkpoints",
    )
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec, description="metrics ports and the Prometheus Operator PodMonitor"
    )
    suspend: bool = Field(default=False, description="scale the engines to 0 and suspend the Jobs")
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="fail the run (and release its pods) this long after it started"
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="delete the children of a finished run this long after it finished (the RLRun and its volume stay)",
    )


def _fields_of(config_cls: type[BaseModel], section: BaseModel) -> dict[str, Any]:
    """The values of `section` that `config_cls` also has, by Python field name."""
    return section.model_dump(include=set(config_cls.model_fields))


def engine_urls(run_name: str, namespace: str, replicas: int) -> list[str]:
    """Stable per-replica base URLs: the StatefulSet's pods under the headless Service."""
    service = child_name(run_name, "engine_headless")
    return [
        f"http://{engine_pod(run_name, i)}.{service}.{namespace}.svc:{ENGINE_PORT}" for i in range(replicas)
    ]


def vllm_args(inference: InferenceSpec) -> list[str]:
    """vLLM's own server arguments for every replica: the tensor parallelism, then `extraArgs`."""
    parallel = inference.tensor_parallel_size
    return [*(["--tensor-parallel-size", str(parallel)] if parallel > 1 else []), *inference.extra_args]


def run_dir(run_name: str, uid: str | None) -> PurePosixPath:
    """The run's own directory on its claim, `/shared/runs/<name>/<uid>`: its images, rollout batches and
    checkpoints live there, so runs that share a claim (an `existingClaim`, or a retained claim a new run
    of the same name takes over) neither mix their files nor resume from each other's checkpoints, as
    KubeRay and Kubeflow jobs on one shared volume each write their own directory. The claim's root stays
    common to them: checkpoints placed there (`model.name: /shared/models/...`) and the hub cache.
    Without a UID (an RLRun not yet stored, a test), `/shared/runs/<name>`."""
    return SHARED_MOUNT / "runs" / run_name / (uid or "")


def run_config(run_name: str, namespace: str, spec: RLRunSpec, *, uid: str | None = None) -> RunConfig:
    """The `RunConfig` the run's pods read from its ConfigMap (and the engines' command line derives from)."""
    return RunConfig(
        name=run_name,
        model=ModelConfig(path=spec.model.name, **_fields_of(ModelSettings, spec.model)),
        shared_dir=Path(run_dir(run_name, uid)),
        inference=InferenceConfig(
            **_fields_of(InferenceSettings, spec.inference),
            urls=engine_urls(run_name, namespace, spec.inference.replicas),
            vllm_args=vllm_args(spec.inference),
        ),
        orchestrator=OrchestratorConfig(**_fields_of(OrchestratorConfig, spec.orchestrator)),
        trainer=TrainerConfig(**_fields_of(TrainerConfig, spec.trainer)),
        monitoring=MonitoringConfig(**_fields_of(MonitoringConfig, spec.monitoring)),
        offload=OffloadConfig(
            retention=RetentionConfig(**_fields_of(RetentionConfig, spec.offload.retention))
        ),
    )


class InvalidSpec(Exception):
    """The spec cannot be reconciled (reported in status and events; retried only when it changes)."""


def parse_spec(name: str, spec: Any) -> RLRunSpec:
    """The validated spec of the RLRun called `name`, or `InvalidSpec` naming every bad field."""
    problem = run_name_problem(name)
    if problem:
        raise InvalidSpec(problem)
    try:
        return RLRunSpec.model_validate(spec or {})
    except ValidationError as exc:
        raise InvalidSpec(format_validation_error(exc, source="spec", what="RLRun spec")) from None
