"""The chart's alert rules: `promtool check rules` accepts them, and `promtool test rules` shows each alert
firing on the series it is about and staying quiet on healthy ones."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from chart_generate import load_generate
from monitoring_helpers import rule_groups, tool, write_rules_file


def promtool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_promtool_check_rules_accepts_the_rendered_rules(tmp_path: Path) -> None:
    rules = write_rules_file(tmp_path / "rules.yaml", rule_groups())
    result = promtool("check", "rules", rules, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_promtool_check_rules_rejects_a_broken_expression(tmp_path: Path) -> None:
    # The check above would pass vacuously if promtool accepted anything.
    groups = rule_groups()
    groups[0]["rules"][0]["expr"] = "sum by (reason (rawmm_invalid_mm_image_ref_total)"
    result = promtool("check", "rules", write_rules_file(tmp_path / "rules.yaml", groups), cwd=tmp_path)
    assert result.returncode != 0


def _labels(**labels: str) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in labels.items())


ENGINE = {"namespace": "ml", "pod": "run-engine-0", "container": "engine", "job": "ml/run"}
GC = {"namespace": "ml", "pod": "run-offload-gc-x", "container": "gc", "job": "ml/run"}
TRAINER = {"namespace": "ml", "pod": "run-trainer-0-x", "container": "trainer", "job": "ml/run"}


def _series(metric: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": f"{metric}{{{_labels(**labels)}}}", "values": values}


def _alert(name: str, at: str, *expected: dict[str, str]) -> dict[str, Any]:
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": labels} for labels in expected]}


def _unit_tests() -> list[dict[str, Any]]:
    """Scenarios for the default thresholds (hit rate < 0.5 at > 0.1 lookups/s for 15m, trainer stalled
    30m, engine down 5m, offload volume over 90% used for 10m); `test_scenarios_assume_the_default_thresholds`
    pins those."""
    bad_ref = {"namespace": "ml", "pod": "run-engine-0", "reason": "hash_mismatch"}
    new_reason = {**bad_ref, "reason": "outside_offload_root"}
    old_flat = {**bad_ref, "reason": "missing_file"}
    low, high, quiet = ({**ENGINE, "pod": f"run-engine-{i}"} for i in range(3))
    return [
        {
            "interval": "1m",
            "input_series": [
                _series("rawmm_invalid_mm_image_ref_total", bad_ref, "0x7 1x10"),
                # Born at 1 in minute 7: increase() alone never sees it.
                _series("rawmm_invalid_mm_image_ref_total", new_reason, "_x7 1x10"),
                _series("rawmm_invalid_mm_image_ref_total", old_flat, "2x17"),
            ],
            "alert_rule_test": [
                _alert("RawmmInvalidImageRefs", "6m"),
                _alert(
                    "RawmmInvalidImageRefs",
                    "8m",
                    {"severity": "warning", **bad_ref},
                    {"severity": "warning", **new_reason},
                ),
                _alert("RawmmInvalidImageRefs", "14m"),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                # 10 hits, 10 misses, 20 in-flight joins a minute: hit rate 0.25 at 0.67 lookups/s (joins are
                # lookups the cache did not serve: hits / (hits + misses) alone would be 0.5).
                _series("rawmm_materialize_cache_hits_total", low, "0+10x40"),
                _series("rawmm_materialize_cache_misses_total", low, "0+10x40"),
                _series("rawmm_materialize_cache_inflight_joins_total", low, "0+20x40"),
                # Hit rate 0.75 (30 of 40).
                _series("rawmm_materialize_cache_hits_total", high, "0+30x40"),
                _series("rawmm_materialize_cache_misses_total", high, "0+6x40"),
                _series("rawmm_materialize_cache_inflight_joins_total", high, "0+4x40"),
                # Hit rate 0.25 but only 4 lookups a minute: no traffic to speak of.
                _series("rawmm_materialize_cache_hits_total", quiet, "0+1x40"),
                _series("rawmm_materialize_cache_misses_total", quiet, "0+3x40"),
                _series("rawmm_materialize_cache_inflight_joins_total", quiet, "0x40"),
            ],
            "alert_rule_test": [
                _alert("RawmmMaterializeCacheHitRateLow", "10m"),  # pending, not yet for 15m
                _alert(
                    "RawmmMaterializeCacheHitRateLow",
                    "30m",
                    {"severity": "warning", "namespace": "ml", "pod": low["pod"]},
                ),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                _series("rawmm_rlruns", {"namespace": "rawmm-system", "phase": "Failed"}, "0 0 1 1"),
                _series("rawmm_rlruns", {"namespace": "rawmm-system", "phase": "Running"}, "2 2 2 2"),
            ],
            "alert_rule_test": [
                _alert("RawmmRLRunFailed", "1m"),
                _alert("RawmmRLRunFailed", "3m", {"severity": "warning", "namespace": "rawmm-system"}),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                # Steps for 10 minutes, then nothing.
                _series("rawmm_trainer_step", TRAINER, "0+1x10 10x50"),
                _series(
                    "rawmm_trainer_step", {**TRAINER, "pod": "other-trainer-0-y", "job": "ml/other"}, "0+1x60"
                ),
            ],
            "alert_rule_test": [
                _alert("RawmmTrainerStalled", "30m"),
                _alert("RawmmTrainerStalled", "50m", {"severity": "critical", **TRAINER}),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                _series("up", ENGINE, "1 1 0x20"),
                _series("up", {**ENGINE, "pod": "run-engine-1"}, "1x22"),
                _series("up", TRAINER, "0x22"),  # not an engine
            ],
            "alert_rule_test": [
                _alert("RawmmEngineDown", "5m"),
                _alert("RawmmEngineDown", "10m", {"severity": "critical", **ENGINE}),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                # 100 GiB volumes: one fills from 85% to 95% at minute 5 and stays there; one stays at 85%.
                _series("rawmm_offload_volume_capacity_bytes", GC, "100x30"),
                _series("rawmm_offload_volume_available_bytes", GC, "15x5 5x25"),
                _series("rawmm_offload_volume_capacity_bytes", {**GC, "pod": "other-offload-gc-y"}, "100x30"),
                _series("rawmm_offload_volume_available_bytes", {**GC, "pod": "other-offload-gc-y"}, "15x30"),
            ],
            "alert_rule_test": [
                _alert("RawmmOffloadVolumeNearlyFull", "10m"),  # pending: not yet full for 10m
                _alert(
                    "RawmmOffloadVolumeNearlyFull",
                    "20m",
                    {"severity": "warning", "namespace": "ml", "pod": GC["pod"]},
                ),
            ],
        },
    ]


def test_scenarios_assume_the_default_thresholds() -> None:
    values = load_generate().yaml.safe_load((load_generate().CHART_DIR / "values.yaml").read_text())
    rules = values["prometheusRule"]
    assert rules["cacheHitRateLow"] == {
        "threshold": 0.5,
        "minLookupsPerSecond": 0.1,
        "for": "15m",
        "severity": "warning",
    }
    assert rules["trainerStalled"]["for"] == "30m" and rules["engineDown"]["for"] == "5m"
    assert rules["offloadVolumeNearlyFull"] == {"threshold": 0.9, "for": "10m", "severity": "warning"}


def test_each_alert_fires_on_its_condition_and_not_on_healthy_series(tmp_path: Path) -> None:
    groups = rule_groups()
    # Annotation templates are checked by `promtool check rules`; here only expressions and labels count.
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    write_rules_file(tmp_path / "rules.yaml", groups)
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": _unit_tests()}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts_tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert alerts_tested == {rule["alert"] for group in groups for rule in group["rules"]}
