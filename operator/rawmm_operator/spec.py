"""The RLRun spec: camelCase models derived from `rawmm.config`, plus the Kubernetes-only settings.

Each RL section subclasses its run-config model, so the hyperparameters, their defaults and their
ranges have one definition; the operator turns a validated spec back into a `RunConfig`
(`run_config`) for the pods. Cross-field rules are declared once (`Rule`): the CRD carries them as CEL
so the API server rejects a bad spec, and the same check runs here so the operator reports one that
reached it anyway (an older CRD, a server without CEL).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

import rawmm
from rawmm.config import (
    EnvironmentConfig,
    InferenceConfig,
    InferenceSettings,
    ModelConfig,
    ModelSettings,
    MonitoringConfig,
    OrchestratorConfig,
    RunConfig,
    SamplingConfig,
    StrictModel,
    TrainerConfig,
    format_validation_error,
)
from rawmm.quantity import BYTE_SIZE_PATTERN, parse_byte_size

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
# Children get names like `<run>-engine-headless` (a DNS-1035 label, 63 characters at most) and pods
# `<run>-trainer-<index>-<suffix>`; the run name leaves room for those.
MAX_RUN_NAME = 40
_RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name an RLRun's children, or None. (The CRD checks the length; this also
    catches dots and leading digits, which RLRun names may have but Service names may not.)"""
    if len(name) > MAX_RUN_NAME:
        return f"the RLRun name must be at most {MAX_RUN_NAME} characters (its children's names extend it)"
    if not _RUN_NAME.match(name):
        return (
            "the RLRun name must be a DNS-1035 label (lowercase letters, digits, '-'; starts with a letter)"
        )
    return None


def default_image(component: Literal["operator", "inference", "trainer"]) -> str:
    return f"ghcr.io/rawmm/rawmm-{component}:{rawmm.__version__}"


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: `cel` for the API server (None where CEL cannot say it cheaply), `holds` for
    the operator, one message for both."""

    cel: str | None
    message: str
    holds: Callable[[Any], bool]


def _is_byte_size(value: int | str) -> bool:
    try:
        parse_byte_size(value)
    except ValueError:
        return False
    return True


def _schema_extra(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": r.cel, "message": r.message} for r in rules if r.cel]


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

    @model_validator(mode="after")
    def _rules_hold(self) -> SpecModel:
        for rule in self.rules:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self


class Resources(SpecModel):
    """Kubernetes resource requests and limits (quantities)."""

    requests: dict[str, int | str] = Field(default_factory=dict)
    limits: dict[str, int | str] = Field(default_factory=dict)


def default_resources(description: str = "", **requests: str) -> Any:
    """A `resources` field whose default requests also appear in the CRD (the server stores them)."""
    return Field(
        default_factory=lambda: Resources(requests=dict(requests)),
        description=description or None,
        json_schema_extra={"default": {"requests": dict(requests)}},
    )


class Scheduling(SpecModel):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)


class ModelSpec(ModelSettings):
    model_config = CAMEL
    name: str = Field(
        min_length=1, description="hub id, or a checkpoint directory under the run's shared volume"
    )


class OffloadSpec(SpecModel):
    """The run's shared volume: offloaded images, rollout batches and checkpoints."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _immutable_optional(field) for field in ("existingClaim", "storageClassName", "accessMode")
            ]
        }
    )

    size: str = Field(default="100Gi", json_schema_extra={"pattern": BYTE_SIZE_PATTERN})
    storage_class_name: str | None = None
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"] = "ReadWriteMany"
    existing_claim: str | None = Field(default=None, description="use this PVC instead of creating one")
    retain_on_delete: bool = Field(default=True, description="keep the created PVC when the RLRun is deleted")


class InferenceSpec(Scheduling, InferenceSettings):
    model_config = CAMEL
    rules = (
        Rule(
            cel="self.engine != 'vllm' || self.gpus >= 1",
            message="the vllm engine needs gpus >= 1 (use engine: transformers for CPU-only engines)",
            holds=lambda s: s.engine != "vllm" or s.gpus >= 1,
        ),
        Rule(
            cel="self.engine == 'vllm' || (self.tensorParallelSize == 1 && size(self.extraArgs) == 0)",
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
                holds=lambda s, part=part: _is_byte_size(getattr(s.resources, part).get("memory", 0)),
            )
            for part in ("requests", "limits")
        ),
    )

    engine: Literal["transformers", "vllm"] = "vllm"
    image: str = default_image("inference")
    gpus: int = Field(default=1, ge=0, description="GPUs per engine replica")
    tensor_parallel_size: int = Field(default=1, ge=1)
    resources: Resources = default_resources(
        "per replica; the operator adds materializeCacheSize to the memory request and limit",
        cpu="4",
        memory="16Gi",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="extra vLLM server arguments (after `--` of `rawmm serve`)"
    )


class EnvironmentSpec(EnvironmentConfig):
    model_config = CAMEL


class SamplingSpec(SamplingConfig):
    model_config = CAMEL


class OrchestratorSpec(Scheduling, OrchestratorConfig):
    model_config = CAMEL
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    image: str = default_image("trainer")
    resources: Resources = default_resources(cpu="2", memory="4Gi")


class TrainerSpec(Scheduling, TrainerConfig):
    model_config = CAMEL
    # TrainerConfig checks this too; the CEL copy lets the API server refuse such an RLRun at creation.
    rules = (
        Rule(
            cel="self.seqLen <= self.microBatchTokens",
            message="seqLen must not exceed microBatchTokens: a truncated sample has to fit in one micro-batch",
            holds=lambda s: s.seq_len <= s.micro_batch_tokens,
        ),
    )
    image: str = default_image("trainer")
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=1, ge=0)
    resources: Resources = default_resources("per node", cpu="8", memory="64Gi")

    @property
    def distributed(self) -> bool:
        return self.nodes > 1 or self.gpus_per_node > 1


class MonitoringSpec(MonitoringConfig):
    model_config = CAMEL
    orchestrator_metrics_port: int = Field(default=9101, ge=1, le=65535)
    trainer_metrics_port: int = Field(default=9102, ge=1, le=65535)
    pod_monitor: bool = Field(default=True, description="create a Prometheus Operator PodMonitor for the run")


class RLRunSpec(SpecModel):
    model: ModelSpec = Field(json_schema_extra=immutable("model"))
    offload: OffloadSpec = Field(default_factory=OffloadSpec)
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    orchestrator: OrchestratorSpec = Field(default_factory=OrchestratorSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    suspend: bool = Field(default=False, description="scale the engines to 0 and suspend the Jobs")


def _fields_of(config_cls: type[BaseModel], section: BaseModel) -> dict[str, Any]:
    """The values of `section` that `config_cls` also has, by Python field name."""
    return section.model_dump(include=set(config_cls.model_fields))


def engine_urls(run_name: str, namespace: str, replicas: int) -> list[str]:
    """Stable per-replica base URLs: StatefulSet pod `<run>-engine-<i>` under the headless Service."""
    service = f"{run_name}-engine-headless"
    return [f"http://{run_name}-engine-{i}.{service}.{namespace}.svc:{ENGINE_PORT}" for i in range(replicas)]


def run_config(run_name: str, namespace: str, spec: RLRunSpec) -> RunConfig:
    """The `RunConfig` the run's pods read from its ConfigMap."""
    return RunConfig(
        name=run_name,
        model=ModelConfig(path=spec.model.name, **_fields_of(ModelSettings, spec.model)),
        shared_dir=Path(SHARED_MOUNT),
        inference=InferenceConfig(
            **_fields_of(InferenceSettings, spec.inference),
            urls=engine_urls(run_name, namespace, spec.inference.replicas),
        ),
        orchestrator=OrchestratorConfig(**_fields_of(OrchestratorConfig, spec.orchestrator)),
        trainer=TrainerConfig(**_fields_of(TrainerConfig, spec.trainer)),
        monitoring=MonitoringConfig(**_fields_of(MonitoringConfig, spec.monitoring)),
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
