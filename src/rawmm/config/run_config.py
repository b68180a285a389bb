"""The one run configuration: what `rawmm run` reads from YAML and what the operator writes for its pods.

Every section is a strict pydantic model (unknown keys are errors). The RLRun spec of the operator
derives its sections from these models, so a field added here with a default appears in both places.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rawmm.config.duration import DURATION_PATTERN, parse_duration
from rawmm.config.quantity import BYTE_SIZE_PATTERN, parse_byte_size

# The families' own records decide which presets and backends exist.
from rawmm.contract.engine_api import MAX_TOKENS_LIMIT, TEMPERATURE_LIMIT

# Re-exported for the RLRun's CEL copy of the check (the operator imports the run config, not the contract).
from rawmm.contract.engine_api import MIN_TEMPERATURE as MIN_TEMPERATURE
from rawmm.contract.engine_api import temperature_problem as temperature_problem
from rawmm.contract.families import Backend as ProcessorBackend
from rawmm.contract.families import Preset, resolve_preset
from rawmm.contract.retention_bounds import check_older_than
from rawmm.contract.shared_dir import SharedDir

# Which engine `rawmm serve` runs (not to be confused with rawmm.serving.engine.Engine, the interface).
EngineKind = Literal["transformers", "vllm"]
MissingImagePolicy = Literal["error", "zero_loss"]
# ddp: every rank holds the whole model and AdamW state; fsdp: FSDP2 shards them over the ranks.
Parallelism = Literal["ddp", "fsdp"]
# checkpoint: every replica reloads each step's checkpoint from the shared volume; broadcast: the trainer sends
# the weights straight into the replicas (docs/architecture.md §6.1).
WeightTransfer = Literal["checkpoint", "broadcast"]


# A run's seeds are 32-bit: every generator they seed takes them, and the RLRun schema can state the bound (the
# API server refuses a maximum of 2**63, which is no int64).
RUN_SEED_LIMIT = 2**32


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names every offending field."""


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    # No inf or nan: `learning_rate: .inf` passes every lower bound and would train to NaN.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSettings(StrictModel):
    """What identifies the processor: shared by the run config and the RLRun's model section."""

    preset: Preset = Field(
        description="the model's image layout (family and processor config): qwen2_vl, qwen2_5_vl, "
        "qwen3_vl or kimi_k25; a checkpoint whose processor config differs is refused by its fingerprint"
    )
    processor_backend: ProcessorBackend | None = Field(
        default=None,
        description="image-processor backend of the engines and the trainer (part of every image ref's "
        "fingerprint); empty: the one vLLM's own image path runs for the preset's family "
        "(torchvision for Qwen-VL, pil for Kimi K2.5)",
    )
    trust_remote_code: bool = Field(
        default=False, description="let transformers (and vLLM) run the checkpoint's own Python code"
    )

    @model_validator(mode="after")
    def _backend_defaults_to_the_familys(self) -> ModelSettings:
        # Resolved here, not in each process, so the run config the pods read names the backend they all
        # load. Not a schema default: the RLRun's stored spec stays empty and follows the family.
        if self.processor_backend is None:
            self.processor_backend = resolve_preset(self.preset)[0].default_backend
        return self

    @property
    def backend(self) -> ProcessorBackend:
        """The processor backend, resolved at validation (the family's default when none was given)."""
        return self.processor_backend or resolve_preset(self.preset)[0].default_backend


class ModelConfig(ModelSettings):
    path: str = Field(min_length=1, description="local checkpoint directory or hub id")


class InferenceSettings(StrictModel):
    """Inference settings shared by local runs and the RLRun's inference section."""

    engine: EngineKind = Field(
        default="transformers",
        description="vllm: vLLM 0.32 with rawmm's raw-ref routes (GPUs); transformers: rawmm's own CPU engine",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="engine replicas; the orchestrator spreads rollouts over them, sticky per rollout",
    )
    materialize_cache_size: str = Field(
        default="2Gi",
        json_schema_extra={"pattern": BYTE_SIZE_PATTERN},
        description="byte budget of each engine's materialize cache: bytes or a quantity such as 2Gi; 0 disables",
    )

    @field_validator("materialize_cache_size", mode="before")
    @classmethod
    def _size_as_text(cls, value: Any) -> Any:
        # YAML reads `0` or `1073741824` as an int; the quantity text is what we keep and pass on.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("materialize_cache_size")
    @classmethod
    def _size_parses(cls, value: str) -> str:
        parse_byte_size(value)
        return value

    @property
    def cache_size_bytes(self) -> int:
        return parse_byte_size(self.materialize_cache_size)


_VLLM_PARALLEL_FLAGS = {
    "--tensor-parallel-size": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size", "-pp": "--pipeline-parallel-size",
    "--data-parallel-size": "--data-parallel-size", "-dp": "--data-parallel-size",
}  # fmt: skip


def _vllm_parallelism(args: list[str]) -> list[str]:
    """The vLLM arguments of ``args`` that give a replica more than one worker (``--tensor-parallel-size 2``)."""
    found = []
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if flag not in _VLLM_PARALLEL_FLAGS:
            continue
        if not value and i + 1 < len(args):
            value = args[i + 1]
        if value.strip() != "1":
            found.append(f"{_VLLM_PARALLEL_FLAGS[flag]} {value}")
    return found


class InferenceConfig(InferenceSettings):
    urls: list[str] = Field(
        default_factory=list, description="engine base URLs; empty means `rawmm run` starts local replicas"
    )
    base_port: int = Field(
        default=8100, ge=1, le=65535, description="`rawmm run` gives local replica i the port base_port + i"
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="extra arguments for vLLM's server of each replica (engine: vllm), "
        "e.g. ['--enforce-eager', '--kv-cache-memory-bytes', '1073741824']",
    )

    @model_validator(mode="after")
    def _vllm_args_need_vllm(self) -> InferenceConfig:
        if self.vllm_args and self.engine != "vllm":
            raise ValueError(f"vllm_args {self.vllm_args} are for engine: vllm, not {self.engine}")
        return self

    @model_validator(mode="after")
    def _local_replicas_have_ports(self) -> InferenceConfig:
        # `rawmm run` gives local replica i the port base_port + i.
        if not self.urls and self.base_port + self.replicas - 1 > 65535:
            raise ValueError(f"base_port {self.base_port} + {self.replicas} replicas runs past port 65535")
        return self

    @field_validator("urls")
    @classmethod
    def _urls_are_http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in urls]


# The environments `rawmm.rl.envs` registers, named here so the run config (and the RLRun's schema) can refuse
# any other name without importing rawmm.rl; tests/rl/envs/test_registry.py holds the two equal.
BUILTIN_ENVIRONMENTS: tuple[str, ...] = ("colours", "shapes", "shapes-multiturn")
# A user's environment: `package.module:attribute`, what rawmm.rl.envs.registry imports (one attribute).
# No backslash (`[.]`): the RLRun's CEL rule quotes it as is.
ENVIRONMENT_REFERENCE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
_ENVIRONMENT_REFERENCE = re.compile(ENVIRONMENT_REFERENCE_PATTERN)


def environment_name_problem(name: str) -> str | None:
    """Why `name` names no environment the orchestrator could load, or None. Only the form of a user's
    `package.module:attribute` is checked: its module exists in the orchestrator's image, not here."""
    if name in BUILTIN_ENVIRONMENTS or _ENVIRONMENT_REFERENCE.match(name):
        return None
    return f"unknown environment {name!r}: use one of {list(BUILTIN_ENVIRONMENTS)} or 'package.module:Class'"


class EnvironmentConfig(StrictModel):
    name: str = Field(
        default="shapes-multiturn",
        min_length=1,
        description=f"a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) or `package.module:Class` "
        "importable in the orchestrator's image",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment, e.g. {reward: partial}"
    )

    @model_validator(mode="after")
    def _name_is_loadable(self) -> EnvironmentConfig:
        # Refused before anything starts: otherwise only the orchestrator, minutes into a run, finds out.
        if (problem := environment_name_problem(self.name)) is not None:
            raise ValueError(problem)
        return self


class SamplingConfig(StrictModel):
    temperature: float = Field(
        default=1.0, ge=0.0, le=TEMPERATURE_LIMIT, description="0: greedy; else at least 0.01"
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="must be 1.0: the trainer scores tokens under the full distribution, so a nucleus "
        "would bias every importance ratio",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature_can_be_sampled(cls, value: float) -> float:
        # The engines refuse it on every request: refused here, before the run starts.
        if (problem := temperature_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_can_be_trained_on(cls, value: float) -> float:
        # The engine reports logprobs under the renormalized nucleus; the trainer scores the full distribution
        # (logits / temperature), so every importance ratio would start at the nucleus mass instead of 1
        # (0.5 at top_p 0.5: the clip then drops every negative-advantage token's gradient).
        if value != 1.0:
            raise ValueError(
                f"top_p {value} cannot be trained on: the trainer scores tokens under the full distribution, "
                "so only top_p 1.0 gives unbiased importance ratios"
            )
        return value


class OrchestratorConfig(StrictModel):
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig, description="the task the rollouts play"
    )
    prompts_per_step: int = Field(default=2, ge=1, description="episodes (distinct seeds) per step")
    rollouts_per_prompt: int = Field(
        default=4, ge=1, description="rollouts per episode; advantages are normalized within them (GRPO)"
    )
    max_turns: int = Field(default=3, ge=1, description="turns per rollout before it is cut off")
    max_tokens: int = Field(
        default=16, ge=1, le=MAX_TOKENS_LIMIT, description="tokens generated per turn at most"
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="how the engines sample")
    # Batch N is sampled with checkpoint N - max_async_level and checkpoint N needs batch N, so 0 would wait
    # forever; 1 = on-policy (every batch sampled with the newest weights).
    max_async_level: int = Field(
        default=1,
        ge=1,
        description="batch N is sampled with the weights of step N - maxAsyncLevel; 1 is on-policy",
    )
    seed: int = Field(
        default=0, ge=0, lt=RUN_SEED_LIMIT, description="seeds the episodes and the engines' sampling"
    )
    checkpoint_timeout_seconds: int = Field(
        default=7200,
        ge=1,
        description="the orchestrator fails when the trainer's checkpoint a step waits for takes longer "
        "(`rawmm orchestrate --checkpoint-timeout` overrides it)",
    )


class TrainerConfig(StrictModel):
    steps: int = Field(default=2, ge=1, description="training steps (one rollout batch each)")
    learning_rate: float = Field(default=1e-5, gt=0.0, description="AdamW's learning rate")
    lr_warmup_steps: int = Field(
        default=0,
        ge=0,
        description="the learning rate rises linearly to learningRate over the first N steps (step n trains "
        "at n/N of it); 0: constant from the first step",
    )
    seq_len: int = Field(
        default=2048, ge=1, description="a sample is truncated to this many tokens, keeping whole images"
    )
    micro_batch_tokens: int = Field(
        default=4096, ge=1, description="tokens packed into one forward/backward pass (per rank)"
    )
    missing_image_policy: MissingImagePolicy = Field(
        default="error",
        description="an image gone from the offload volume: error stops the run naming it; zero_loss drops "
        "that sample's loss only",
    )
    # the ratio is clipped to [1 - low, 1 + high]; low >= 1 would allow a zero or negative ratio
    clip_ratio_low: float = Field(
        default=0.2, ge=0.0, lt=1.0, description="the importance ratio is clipped below at 1 - clipRatioLow"
    )
    clip_ratio_high: float = Field(
        default=0.28, ge=0.0, description="the importance ratio is clipped above at 1 + clipRatioHigh"
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="gradients are clipped to this global norm")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW's decoupled weight decay")
    seed: int = Field(default=0, ge=0, lt=RUN_SEED_LIMIT, description="seeds the trainer's generators")
    parallelism: Parallelism = Field(
        default="ddp",
        description="ddp: every rank holds the whole model and AdamW state; fsdp: FSDP2 shards them over "
        "the ranks (about 1/world each; bf16 compute on GPUs): what a model too large for one GPU needs",
    )
    # recompute each layer's activations in backward: less memory for about one more forward pass
    activation_checkpointing: bool = Field(
        default=False,
        description="recompute each layer's activations in backward: less memory for about one more forward",
    )
    compile: bool = Field(
        default=False,
        description="compile each decoder layer and vision block with torch.compile: fewer, fused kernels for "
        "their elementwise work, after a first step that spends tens of seconds compiling",
    )
    batch_timeout_seconds: int = Field(
        default=7200,
        ge=1,
        description="the trainer fails when a step's rollout batch takes longer "
        "(`rawmm train --batch-timeout` overrides it)",
    )
    weight_transfer: WeightTransfer = Field(
        default="checkpoint",
        description="how each step's weights reach the engines: checkpoint, every replica reloads the step's "
        "checkpoint from the shared volume; broadcast, the trainer's rank 0 sends them into every replica "
        "(vLLM's weight-transfer protocol over gloo, on both engines; every replica must reach the "
        "trainer's rank 0), and a replica that missed an update reloads the latest checkpoint",
    )
    checkpoint_every: int = Field(
        default=1,
        ge=1,
        description="write a checkpoint (what a resume and a replica's catch-up read) every N steps, on the "
        "last step, and on a step whose broadcast did not reach every replica; above 1 only with "
        "weightTransfer broadcast (in checkpoint mode each step's weights travel by checkpoint)",
    )

    @model_validator(mode="after")
    def _seq_len_fits_a_micro_batch(self) -> TrainerConfig:
        # Checked here, not in the trainer, so `rawmm run` and the operator refuse it before starting anything.
        if self.seq_len > self.micro_batch_tokens:
            raise ValueError(
                f"trainer.seq_len ({self.seq_len}) must not exceed trainer.micro_batch_tokens "
                f"({self.micro_batch_tokens}): a truncated sample has to fit in one micro-batch"
            )
        if self.checkpoint_every > 1 and self.weight_transfer != "broadcast":
            raise ValueError(
                f"trainer.checkpoint_every {self.checkpoint_every} needs trainer.weight_transfer broadcast: "
                "in checkpoint mode every step's weights reach the engines by its checkpoint"
            )
        return self


class MonitoringConfig(StrictModel):
    """Metrics ports (engines serve /metrics on their HTTP port). 0 = pick a free port / disabled in tests."""

    orchestrator_metrics_port: int = Field(
        default=9101, ge=0, le=65535, description="/metrics of the orchestrator"
    )
    trainer_metrics_port: int = Field(
        default=9102, ge=0, le=65535, description="/metrics of the trainer (its rank 0)"
    )


class RetentionConfig(StrictModel):
    """Garbage collection of the offload volume (`rawmm gc`); off by default, so nothing is ever deleted.

    A pass runs after each new checkpoint and removes the images unused for `older_than` that no batch
    still waiting for training references (nor the last `keep_steps` trained ones).
    """

    enabled: bool = Field(
        default=False, description="run offload garbage collection; off: nothing is deleted"
    )
    older_than: str = Field(
        default="24h",
        json_schema_extra={"pattern": DURATION_PATTERN},
        description="an image unused for this long may go (e.g. 90m, 24h, 7d; at least 10m); it must exceed "
        "the time from an image's last use in a rollout to its batch landing on the volume",
    )
    keep_steps: int = Field(default=0, ge=0, description="also keep the images of the last N trained steps")
    metrics_port: int = Field(
        default=9103, ge=0, le=65535, description="/metrics of the GC process; 0 = none"
    )

    @field_validator("older_than")
    @classmethod
    def _older_than_is_safe(cls, value: str) -> str:
        check_older_than(parse_duration(value))
        return value

    @property
    def older_than_seconds(self) -> int:
        return parse_duration(self.older_than)


class OffloadConfig(StrictModel):
    retention: RetentionConfig = Field(default_factory=RetentionConfig)


class RunConfig(StrictModel):
    name: str = Field(default="rawmm-run", min_length=1)
    model: ModelConfig
    shared_dir: Path
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)

    @model_validator(mode="after")
    def _broadcast_needs_one_worker_per_replica(self) -> RunConfig:
        # Refused here, before anything starts: otherwise every update falls back to a reload, minutes in.
        # vLLM's side of the broadcast (serving/vllm_weight_transfer.py) receives into one worker per replica.
        if self.trainer.weight_transfer == "broadcast" and self.inference.engine == "vllm":
            parallel = _vllm_parallelism(self.inference.vllm_args)
            if parallel:
                raise ValueError(
                    f"trainer.weight_transfer broadcast with inference.engine vllm needs one worker per "
                    f"replica: inference.vllm_args set {parallel} (use weight_transfer: checkpoint)"
                )
        return self

    @property
    def offload_dir(self) -> Path:
        return SharedDir(self.shared_dir).offload_dir

    @property
    def rollouts_dir(self) -> Path:
        return SharedDir(self.shared_dir).rollouts_dir

    @property
    def checkpoints_dir(self) -> Path:
        return SharedDir(self.shared_dir).checkpoints_dir

    @property
    def weights_step_path(self) -> Path:
        """With `trainer.weight_transfer: broadcast`, `checkpoints/weights_step`: the newest step whose weights
        every live replica holds, as text, replaced atomically by the trainer's rank 0 after each update (the
        orchestrator waits on it as it waits on `checkpoints/latest` in checkpoint mode)."""
        return self.checkpoints_dir / "weights_step"

    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "run config") -> RunConfig:
        """Validate parsed YAML/JSON; raise `ConfigError` listing every bad field by its dotted path."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source=source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read run config: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start]:#04x})"
            ) from None
        try:
            data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_error_line(path, exc)) from None
        return cls.from_mapping(data, source=str(path))

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The YAML text (snake_case, every field); also written to `path` when given."""
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping repeating a key: YAML lets the last one silently win, so a
    setting written twice would be half ignored."""


def _mapping_without_repeats(loader: UniqueKeyLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys written here override the base's
            continue
        key = loader.construct_object(key_node)
        if isinstance(key, Hashable):  # an unhashable key is construct_mapping's own error
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"the key {key!r} is repeated", problem_mark=key_node.start_mark
                )
            seen.add(key)
    return loader.construct_mapping(node)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def yaml_error_line(path: Path, exc: yaml.YAMLError) -> str:
    """``file:line:column: problem`` (1-based, as editors count), one line."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: not valid YAML: {problem}"


def format_validation_error(exc: ValidationError, *, source: str, what: str = "run config") -> str:
    """One line naming every problem by its field's dotted path (`inference.replicas: ...; trainer.steps: ...`)."""
    lines = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        elif error["type"] == "missing":
            message = "required field is missing"
        lines.append(f"{field}: {message}")
    return f"{source}: invalid {what}: " + "; ".join(lines)
