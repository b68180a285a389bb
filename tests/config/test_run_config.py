from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rawmm.config import ConfigError, RunConfig

MINIMAL = {"model": {"path": "/models/tiny", "preset": "qwen2_vl"}, "shared_dir": "/tmp/run"}


def write_yaml(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_minimal_yaml_fills_documented_defaults_and_derived_dirs(tmp_path: Path) -> None:
    config = RunConfig.from_yaml(write_yaml(tmp_path, MINIMAL))
    assert config.name == "rawmm-run"
    assert config.inference.engine == "transformers"
    assert config.inference.cache_size_bytes == 2 * 1024**3
    assert config.inference.urls == []
    assert config.orchestrator.environment.name == "shapes-multiturn"
    assert config.trainer.missing_image_policy == "error"
    assert config.monitoring.orchestrator_metrics_port == 9101
    assert config.offload_dir == Path("/tmp/run/images")
    assert config.rollouts_dir == Path("/tmp/run/rollouts")
    assert config.checkpoints_dir == Path("/tmp/run/checkpoints")


@pytest.mark.parametrize(
    ("preset", "engine", "backend"),
    [
        ("qwen2_vl", "transformers", "torchvision"),
        ("qwen3_vl", "vllm", "torchvision"),
        ("kimi_k25", "vllm", "pil"),
    ],
)
def test_processor_backend_defaults_to_what_vllms_own_path_runs(
    tmp_path: Path, preset: str, engine: str, backend: str
) -> None:
    """One backend for engines and trainer, whatever the engine: the family's processor as vLLM's own
    image path runs it (Qwen-VL: transformers' torchvision processor; Kimi K2.5: its PIL resize). It is
    written out, so every process reading the run config loads the same one."""
    data = {**MINIMAL, "model": {"path": "/m", "preset": preset}, "inference": {"engine": engine}}
    config = RunConfig.from_yaml(write_yaml(tmp_path, data))
    assert config.model.processor_backend == config.model.backend == backend
    assert yaml.safe_load(config.to_yaml())["model"]["processor_backend"] == backend
    explicit = RunConfig.from_mapping({**data, "model": {**data["model"], "processor_backend": "pil"}})
    assert explicit.model.backend == "pil"


@pytest.mark.parametrize(
    "name", ["shapes", "shapes-multiturn", "colours", "my_pkg.envs:Colours", "envs:make"]
)
def test_builtin_environments_and_module_references_are_accepted(name: str) -> None:
    config = RunConfig.from_mapping({**MINIMAL, "orchestrator": {"environment": {"name": name}}})
    assert config.orchestrator.environment.name == name


@pytest.mark.parametrize(
    "name", ["shapes_multiturn", "Shapes", "my_pkg.envs", "my_pkg:envs.Colours", ":Colours"]
)
def test_an_unknown_environment_is_refused_before_anything_starts(name: str) -> None:
    """Not only when the orchestrator starts (minutes into a run, or an RLRun already Running)."""
    with pytest.raises(
        ConfigError, match=rf"orchestrator.environment: unknown environment '{name}': use one of"
    ):
        RunConfig.from_mapping({**MINIMAL, "orchestrator": {"environment": {"name": name}}})


def test_yaml_round_trip_keeps_every_value(tmp_path: Path) -> None:
    data = {
        **MINIMAL,
        "name": "exp-1",
        "model": {
            "path": "Qwen/Qwen3-VL-4B-Instruct",
            "preset": "qwen3_vl",
            "processor_backend": "torchvision",
        },
        "inference": {
            "engine": "vllm",
            "replicas": 3,
            "materialize_cache_size": "4Gi",
            "urls": ["http://e-0:8000/"],
        },
        "orchestrator": {
            "environment": {"name": "shapes", "args": {"max_shapes": 5}},
            "sampling": {"temperature": 0.7},
        },
        "trainer": {"steps": 7, "learning_rate": 3e-6, "missing_image_policy": "zero_loss"},
    }
    config = RunConfig.from_yaml(write_yaml(tmp_path, data))
    out = tmp_path / "out.yaml"
    text = config.to_yaml(out)
    assert out.read_text() == text
    assert RunConfig.from_yaml(out) == config
    dumped = yaml.safe_load(text)
    assert dumped["shared_dir"] == "/tmp/run"
    assert dumped["inference"]["urls"] == ["http://e-0:8000"]  # trailing slash normalized
    assert dumped["orchestrator"]["environment"]["args"] == {"max_shapes": 5}
    assert dumped["trainer"]["learning_rate"] == 3e-6


def test_integer_cache_size_from_yaml_is_kept_as_text(tmp_path: Path) -> None:
    config = RunConfig.from_yaml(
        write_yaml(tmp_path, {**MINIMAL, "inference": {"materialize_cache_size": 0}})
    )
    assert config.inference.materialize_cache_size == "0"
    assert config.inference.cache_size_bytes == 0


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        (
            {"inference": {"materialize_cache_size": "2GB"}},
            "inference.materialize_cache_size",
            "invalid byte size '2GB'",
        ),
        ({"inference": {"replicas": 0}}, "inference.replicas", "greater than or equal to 1"),
        ({"inference": {"engine": "tgi"}}, "inference.engine", "'transformers' or 'vllm'"),
        ({"inference": {"urls": ["engine-0:8000"]}}, "inference.urls", "must start with http"),
        ({"inference": {"cache": "2Gi"}}, "inference.cache", "unknown field"),
        ({"orchestrator": {"sampling": {"top_p": 0}}}, "orchestrator.sampling.top_p", "greater than 0"),
        (
            {"orchestrator": {"sampling": {"top_p": 0.9}}},
            "orchestrator.sampling.top_p",
            "cannot be trained on",
        ),
        (
            {"orchestrator": {"max_async_level": 0}},
            "orchestrator.max_async_level",
            "greater than or equal to 1",
        ),
        (
            {"trainer": {"missing_image_policy": "skip"}},
            "trainer.missing_image_policy",
            "'error' or 'zero_loss'",
        ),
        ({"trainer": {"learning_rate": -1}}, "trainer.learning_rate", "greater than 0"),
        (
            {"trainer": {"seq_len": 1024, "micro_batch_tokens": 512}},
            "trainer",
            "trainer.seq_len (1024) must not exceed trainer.micro_batch_tokens (512)",
        ),
        (
            {"monitoring": {"trainer_metrics_port": 70000}},
            "monitoring.trainer_metrics_port",
            "less than or equal",
        ),
        ({"model": {"path": "/m", "preset": "llava"}}, "model.preset", "qwen2_vl"),
        ({"model": {"preset": "qwen2_vl"}}, "model.path", "required field is missing"),
        ({"extra_top": 1}, "extra_top", "unknown field"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, patch: dict, field: str, fragment: str) -> None:
    path = write_yaml(tmp_path, {**MINIMAL, **patch})
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    message = str(info.value)
    assert str(path) in message
    assert f"{field}: " in message
    assert fragment in message


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"model": {"path": "/m", "preset": "qwen2_vl"}, "trainer": {"steps": 0}})
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    assert "shared_dir: required field is missing" in str(info.value)
    assert "trainer.steps: " in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "", "key: [unclosed\n"])
def test_non_mapping_or_broken_yaml_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=str(path)):
        RunConfig.from_yaml(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read run config"):
        RunConfig.from_yaml(tmp_path / "absent.yaml")


def test_assignment_is_validated() -> None:
    config = RunConfig.from_mapping(MINIMAL)
    with pytest.raises(ValueError, match="invalid byte size"):
        config.inference.materialize_cache_size = "lots"


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: t\nmodel:\n  path: [unclosed\n  preset: qwen2_vl\n")
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:4:9: not valid YAML: "), message


def test_the_sampling_the_config_accepts_is_what_the_engine_schema_accepts(tmp_path: Path) -> None:
    """At the engine API's limits both accept; one past them the config refuses up front, as the engines would
    refuse every request."""
    from pydantic import ValidationError

    from rawmm.contract.engine_api import MAX_TOKENS_LIMIT, TEMPERATURE_LIMIT, Sampling

    for max_tokens, temperature in (
        (MAX_TOKENS_LIMIT, TEMPERATURE_LIMIT),
        (MAX_TOKENS_LIMIT + 1, 1.0),
        (16, 101.0),
    ):
        over = max_tokens > MAX_TOKENS_LIMIT or temperature > TEMPERATURE_LIMIT
        orchestrator = {"max_tokens": max_tokens, "sampling": {"temperature": temperature}}
        path = write_yaml(tmp_path, {**MINIMAL, "orchestrator": orchestrator})
        try:
            RunConfig.from_yaml(path)
            config_accepts = True
        except ConfigError:
            config_accepts = False
        try:
            Sampling(max_tokens=max_tokens, temperature=temperature)
            engine_accepts = True
        except ValidationError:
            engine_accepts = False
        assert config_accepts == engine_accepts == (not over)


def test_a_temperature_the_engines_refuse_is_refused_up_front(tmp_path: Path) -> None:
    from rawmm.contract.engine_api import MIN_TEMPERATURE

    for temperature, accepted in ((0.0, True), (MIN_TEMPERATURE, True), (0.001, False), (1e-40, False)):
        path = write_yaml(tmp_path, {**MINIMAL, "orchestrator": {"sampling": {"temperature": temperature}}})
        if accepted:
            assert RunConfig.from_yaml(path).orchestrator.sampling.temperature == temperature
            continue
        with pytest.raises(ConfigError, match=r"orchestrator\.sampling\.temperature: .*below the minimum"):
            RunConfig.from_yaml(path)


def test_bad_values_the_bounds_would_let_through_are_refused_in_one_line(tmp_path: Path) -> None:
    for section, problem in (
        ({"trainer": {"learning_rate": float("inf")}}, "trainer.learning_rate"),
        ({"trainer": {"max_grad_norm": float("nan")}}, "trainer.max_grad_norm"),
        ({"trainer": {"seed": 10**26}}, "trainer.seed"),
        ({"orchestrator": {"seed": -1}}, "orchestrator.seed"),
        ({"inference": {"base_port": 65535, "replicas": 3}}, "past port 65535"),
    ):
        path = write_yaml(tmp_path, {**MINIMAL, **section})
        with pytest.raises(ConfigError) as info:
            RunConfig.from_yaml(path)
        assert problem in str(info.value) and "\n" not in str(info.value), str(info.value)
    # Remote engines' ports are their URLs': base_port plays no part.
    remote = {"base_port": 65535, "replicas": 3, "urls": ["http://a:1", "http://b:1", "http://c:1"]}
    assert RunConfig.from_mapping({**MINIMAL, "inference": remote}).inference.replicas == 3


def test_a_run_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: not UTF-8 text \(byte 9: 0xe9\)$"):
        RunConfig.from_yaml(path)


def test_a_key_written_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m, preset: qwen2_vl}\nshared_dir: s\ntrainer:\n  steps: 2\n  steps: 20\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:5:3: not valid YAML: the key 'steps' is repeated$"):
        RunConfig.from_yaml(path)
    # Merge keys and the same key in different mappings are no repeat.
    path.write_text("model: {path: m, preset: qwen2_vl}\nshared_dir: s\nbase: &b {steps: 3}\n")
    with pytest.raises(ConfigError, match="base: unknown field"):
        RunConfig.from_yaml(path)
    path.write_text(
        "model: {path: m, preset: qwen2_vl}\nshared_dir: s\ntrainer: {<<: {steps: 3}, seq_len: 8}\n"
    )
    config = RunConfig.from_yaml(path)
    assert (config.trainer.steps, config.model.path) == (3, "m")


def test_weight_transfer_defaults_to_checkpoint_and_takes_broadcast(tmp_path: Path) -> None:
    assert RunConfig.from_mapping(MINIMAL).trainer.weight_transfer == "checkpoint"
    data = {**MINIMAL, "trainer": {"weight_transfer": "broadcast"}}
    config = RunConfig.from_yaml(write_yaml(tmp_path, data))
    assert (config.trainer.weight_transfer, config.trainer.checkpoint_every) == ("broadcast", 1)
    assert config.weights_step_path == Path("/tmp/run/checkpoints/weights_step")
    assert RunConfig.from_yaml(write_yaml(tmp_path, yaml.safe_load(config.to_yaml()))) == config
    # Both engines take it (the vLLM engine through vLLM's own weight-transfer API).
    on_vllm = {**data, "inference": {"engine": "vllm", "vllm_args": ["--tensor-parallel-size", "1"]}}
    assert RunConfig.from_mapping(on_vllm).inference.engine == "vllm"


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        ({"trainer": {"weight_transfer": "nccl"}}, "trainer.weight_transfer", "'checkpoint' or 'broadcast'"),
        ({"trainer": {"weight_transfer": ""}}, "trainer.weight_transfer", "'checkpoint' or 'broadcast'"),
        (
            {
                "trainer": {"weight_transfer": "broadcast"},
                "inference": {"engine": "vllm", "vllm_args": ["--enforce-eager", "-tp", "2"]},
            },
            "(top level)",
            "broadcast with inference.engine vllm needs one worker per replica: "
            "inference.vllm_args set ['--tensor-parallel-size 2']",
        ),
        (
            {
                "trainer": {"weight_transfer": "broadcast"},
                "inference": {"engine": "vllm", "vllm_args": ["--pipeline_parallel_size=2"]},
            },
            "(top level)",
            "inference.vllm_args set ['--pipeline-parallel-size 2']",
        ),
        (
            {"trainer": {"checkpoint_every": 4}},
            "trainer",
            "trainer.checkpoint_every 4 needs trainer.weight_transfer broadcast",
        ),
        (
            {"trainer": {"weight_transfer": "broadcast", "checkpoint_every": 0}},
            "trainer.checkpoint_every",
            "greater than or equal to 1",
        ),
    ],
)
def test_a_weight_transfer_that_cannot_run_is_refused_naming_the_field(
    tmp_path: Path, patch: dict, field: str, fragment: str
) -> None:
    path = write_yaml(tmp_path, {**MINIMAL, **patch})
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    assert f"{field}: " in str(info.value) and fragment in str(info.value), str(info.value)
