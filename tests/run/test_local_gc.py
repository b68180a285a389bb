"""`rawmm run` with retention on: GC passes between steps in their own process, stopped with the run."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml
from ports import free_port
from retention_kit import HOUR, age, png

from rawmm.config import RunConfig
from rawmm.contract import OffloadStore
from rawmm.run import LocalRun, PlanError, plan_local_run

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-tiny.yaml"


def tiny_config(model: str, *, retention: dict[str, object]) -> RunConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["path"] = model
    data["inference"]["base_port"] = free_port()
    data["orchestrator"].update(
        {"prompts_per_step": 1, "rollouts_per_prompt": 2, "max_turns": 2, "max_tokens": 4}
    )
    data["trainer"]["steps"] = 2
    data["offload"] = {"retention": {"metrics_port": free_port(), **retention}}
    return RunConfig.model_validate(data)


def test_a_busy_gc_metrics_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        retention = {"enabled": True, "metrics_port": port}
        with pytest.raises(PlanError, match="offload.retention.metrics_port"):
            plan_local_run(tiny_config("tiny:qwen2_vl", retention=retention), output_dir=tmp_path)
        plan_local_run(
            tiny_config("tiny:qwen2_vl", retention={**retention, "enabled": False}), output_dir=tmp_path
        )


def test_retention_adds_a_gc_watch_process_and_only_then(tmp_path: Path) -> None:
    off = LocalRun(plan_local_run(tiny_config("tiny:qwen2_vl", retention={}), output_dir=tmp_path / "off"))
    assert off.gc is None and all(child.name != "gc" for child in off.children)
    plan = plan_local_run(
        tiny_config("tiny:qwen2_vl", retention={"enabled": True}), output_dir=tmp_path / "on"
    )
    run = LocalRun(plan)
    assert run.gc is not None and run.gc in run.children
    assert run.gc.argv[-6:] == [
        "gc",
        "--config",
        str(plan.config_path),
        "--watch",
        "--metrics-host",
        "127.0.0.1",
    ]


@pytest.mark.slow
def test_a_run_with_retention_collects_old_images_between_steps_and_trains_on_every_image(
    tmp_path: Path, tiny_qwen2_vl: Path
) -> None:
    plan = plan_local_run(
        tiny_config(str(tiny_qwen2_vl), retention={"enabled": True, "older_than": "1h"}), output_dir=tmp_path
    )
    leftovers = [
        OffloadStore(plan.config.offload_dir).put(png(seed)) for seed in range(5)
    ]  # an earlier run's
    for stored in leftovers:
        age(stored.path, 2 * HOUR)

    run = LocalRun(plan)
    summary = run.run()

    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert run.gc is not None and run.gc.pid is not None
    passes = [json.loads(line) for line in run.gc.log_path.read_text().splitlines() if line.startswith("{")]
    assert passes and passes[0]["event"] == "gc" and passes[0]["removed_files"] == len(leftovers)
    assert not any(stored.path.exists() for stored in leftovers)
    trainer = [
        json.loads(line) for line in run.trainer.log_path.read_text().splitlines() if line.startswith("{")
    ]
    assert [line["missing_images"] for line in trainer] == [0, 0] and all(
        line["images"] > 0 for line in trainer
    )
    assert any(plan.config.offload_dir.glob("*/*.png"))  # the run's own images are young: all kept
