from __future__ import annotations

import pytest
import yaml
from operator_samples import CPU_ONLY, ISSUE_EXAMPLE, MULTI_NODE, SPECS, merged

import rawmm
from rawmm.config import RunConfig
from rawmm_operator.spec import InvalidSpec, RLRunSpec, default_image, engine_urls, parse_spec, run_config


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sample_specs_parse(name: str) -> None:
    assert isinstance(parse_spec("run", SPECS[name]), RLRunSpec)


def test_spec_is_camel_case_and_inherits_the_run_config_defaults() -> None:
    spec = parse_spec("run", {"model": {"name": "m", "preset": "qwen2_vl"}})
    config_defaults = RunConfig.model_validate(
        {"model": {"path": "m", "preset": "qwen2_vl"}, "shared_dir": "/s"}
    )
    assert spec.orchestrator.prompts_per_step == config_defaults.orchestrator.prompts_per_step
    assert spec.trainer.clip_ratio_high == config_defaults.trainer.clip_ratio_high
    assert spec.inference.materialize_cache_size == config_defaults.inference.materialize_cache_size
    assert spec.inference.engine == "vllm"  # the cluster default differs from local runs on purpose
    # images are resolved from the operator's release at reconcile time, never stored
    assert spec.inference.image == spec.orchestrator.image == spec.trainer.image == ""
    assert default_image("inference") == f"ghcr.io/rawmm/rawmm-inference:{rawmm.__version__}"
    with pytest.raises(InvalidSpec, match="orchestrator.prompts_per_step: unknown field"):
        parse_spec(
            "run", {"model": {"name": "m", "preset": "qwen2_vl"}, "orchestrator": {"prompts_per_step": 3}}
        )


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        (
            {"inference": {"materializeCacheSize": "lots"}},
            "inference.materializeCacheSize: invalid byte size 'lots'",
        ),
        ({"inference": {"gpus": 0, "image": ""}}, "the vllm engine needs gpus >= 1"),
        ({"inference": {"gpus": 2, "tensorParallelSize": 4}}, "tensorParallelSize cannot exceed"),
        (
            {"inference": {"engine": "transformers", "extraArgs": ["--enforce-eager"]}},
            "they need engine: vllm",
        ),
        (
            {"inference": {"resources": {"requests": {"memory": "1e9"}}}},
            "resources.requests.memory must be bytes",
        ),
        ({"trainer": {"nodes": 0}}, "trainer.nodes: "),
        ({"trainer": {"clipRatioLow": 1.0}}, "trainer.clipRatioLow: "),
        ({"offload": {"accessMode": "ReadOnlyMany"}}, "offload.accessMode: "),
        ({"offload": {"accessMode": "ReadWriteOncePod"}}, "offload.accessMode: "),
        (
            {"offload": {"accessMode": "ReadWriteOnce"}, "trainer": {"nodes": 2}},
            "ReadWriteOnce keeps every pod on one node",
        ),
        ({"inference": {"volumes": [{"name": "shared", "emptyDir": {}}]}}, "volumes may not be named"),
        (
            {"trainer": {"volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}},
            "volumeMounts may not mount",
        ),
        ({"inference": {"acceleratorResource": "nvidia com/gpu"}}, "inference.acceleratorResource: "),
        # Server-side apply cannot build a patch from such lists (list-map keys): refused before it is tried.
        (
            {"inference": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            "two env entries share",
        ),
        (
            {"trainer": {"volumes": [{"name": "d", "emptyDir": {}}, {"name": "d", "emptyDir": {}}]}},
            "two volumes share a name",
        ),
        (
            {
                "trainer": {
                    "volumeMounts": [
                        {"name": "a", "mountPath": "/data"},
                        {"name": "b", "mountPath": "/data/"},
                    ]
                }
            },
            "two volumeMounts share a mountPath",
        ),
        (
            {"trainer": {"volumeMounts": [{"name": "x", "mountPath": "/shared/"}]}},
            "volumeMounts may not mount",
        ),
        ({"monitoring": {"trainerMetricsPort": 29500}}, "torchrun's rendezvous port"),
        # vLLM's side of the broadcast receives into one worker per replica
        (
            {"trainer": {"weightTransfer": "broadcast"}, "inference": {"gpus": 2, "tensorParallelSize": 2}},
            "broadcast with inference.engine vllm needs inference.tensorParallelSize 1",
        ),
        (
            {
                "inference": {"engine": "transformers"},
                "trainer": {"weightTransfer": "broadcast"},
                "monitoring": {"trainerMetricsPort": 29501},
            },
            "29501 is the weight broadcast's rendezvous port",
        ),
        ({"suspend": "yes please"}, "suspend: "),
        ({"extra": 1}, "extra: unknown field"),
    ],
)
def test_bad_specs_name_the_field(patch: dict, fragment: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_spec("run", merged(ISSUE_EXAMPLE, patch))
    assert fragment in str(info.value)


def test_a_cpu_vllm_engine_runs_from_an_image_of_vllms_cpu_build() -> None:
    """gpus 0 with the default image (vLLM's CUDA build) is refused above; naming an image is accepted."""
    cpu = {"inference": {"gpus": 0, "image": "registry.example/rawmm-inference:0.1.0-cpu"}}
    spec = parse_spec("run", merged(ISSUE_EXAMPLE, cpu))
    assert (spec.inference.engine, spec.inference.gpus) == ("vllm", 0)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("a" * 41, "at most 40 characters"),
        ("run.v2", "DNS-1035"),
        ("7th-run", "DNS-1035"),
        ("Run", "DNS-1035"),
    ],
)
def test_names_that_cannot_name_children_are_invalid(name: str, fragment: str) -> None:
    with pytest.raises(InvalidSpec, match=fragment):
        parse_spec(name, CPU_ONLY)


def test_an_rlrun_without_a_processor_backend_runs_the_one_vllms_own_path_runs() -> None:
    """The RLRun stores no backend (no schema default), so its pods follow the family's: the engines and the
    trainer all read it from the run config, and the engines' command line names it."""
    from rawmm.config.serve_argv import serve_argv

    spec = parse_spec("exp", merged(ISSUE_EXAMPLE, {"model": {"processorBackend": None}}))
    assert spec.model.processor_backend == "torchvision"
    config = run_config("exp", "ml", spec)
    assert yaml.safe_load(config.to_yaml())["model"]["processor_backend"] == "torchvision"
    argv = serve_argv(config, host="0.0.0.0", port=8000)
    assert argv[argv.index("--processor-backend") + 1] == "torchvision"


def test_an_unknown_environment_is_an_invalid_spec_not_a_running_run() -> None:
    """One stored past the CRD's rule (an older CRD) is reported invalid, not Running until the orchestrator fails."""
    with pytest.raises(InvalidSpec, match=r"orchestrator.environment: unknown environment 'shape'"):
        parse_spec("exp", merged(ISSUE_EXAMPLE, {"orchestrator": {"environment": {"name": "shape"}}}))


def test_run_config_for_the_pods() -> None:
    spec = parse_spec("exp", ISSUE_EXAMPLE)
    config = run_config("exp", "ml", spec)
    # The ConfigMap text must load back through the same strict loader the pods use.
    assert RunConfig.from_mapping(yaml.safe_load(config.to_yaml())) == config
    assert config.name == "exp"
    assert config.model.path == "Qwen/Qwen3-VL-4B-Instruct"
    assert config.model.processor_backend == "torchvision"
    assert str(config.shared_dir) == "/shared/runs/exp"  # no UID given: the run's name alone
    assert str(run_config("exp", "ml", spec, uid="u-1").shared_dir) == "/shared/runs/exp/u-1"
    assert config.inference.engine == "vllm"
    assert config.inference.materialize_cache_size == "4Gi"
    assert config.inference.urls == [
        "http://exp-engine-0.exp-engine-headless.ml.svc:8000",
        "http://exp-engine-1.exp-engine-headless.ml.svc:8000",
    ]
    assert config.orchestrator.prompts_per_step == 8
    assert config.orchestrator.max_tokens == 256
    assert config.trainer.learning_rate == 1e-6
    assert config.trainer.seq_len == 8192


def test_engine_urls_follow_the_replica_count() -> None:
    spec = parse_spec("big", MULTI_NODE)
    assert run_config("big", "team", spec).inference.urls == engine_urls("big", "team", 4)
    assert len(set(engine_urls("big", "team", 4))) == 4


def test_default_images_follow_the_image_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # the chart's runs.images.registry/tag, as the operator's environment
    monkeypatch.setenv("RAWMM_IMAGE_REGISTRY", "registry.example.com/team/")
    monkeypatch.setenv("RAWMM_IMAGE_TAG", "dev-1")
    assert default_image("trainer") == "registry.example.com/team/rawmm-trainer:dev-1"
    monkeypatch.setenv("RAWMM_IMAGE_TAG", "")
    assert default_image("inference") == f"registry.example.com/team/rawmm-inference:{rawmm.__version__}"


def test_a_broadcast_run_with_the_transformers_engine_is_accepted() -> None:
    """The operator gives the trainer the token and the rendezvous now: no more refusal of broadcast."""
    spec = parse_spec("exp", merged(CPU_ONLY, {"trainer": {"weightTransfer": "broadcast"}}))
    config = run_config("exp", "ml", spec)
    assert (config.trainer.weight_transfer, config.inference.engine) == ("broadcast", "transformers")
    assert RunConfig.from_mapping(yaml.safe_load(config.to_yaml())) == config
    # 29501 is free for metrics where nothing broadcasts
    parse_spec("exp", merged(CPU_ONLY, {"monitoring": {"trainerMetricsPort": 29501}}))


def test_a_broadcast_run_with_the_vllm_engine_is_accepted() -> None:
    """`rawmm serve --engine vllm` serves the weight-transfer routes (vLLM's own weight-transfer API)."""
    spec = parse_spec("exp", merged(ISSUE_EXAMPLE, {"trainer": {"weightTransfer": "broadcast"}}))
    config = run_config("exp", "ml", spec)
    assert (config.trainer.weight_transfer, config.inference.engine) == ("broadcast", "vllm")
    assert RunConfig.from_mapping(yaml.safe_load(config.to_yaml())) == config
