"""Durations (`90s`, `10m`, `1h30m`, `7d`) and the retention section that uses them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schema_patterns import parser_agrees_with_pattern

from rawmm.config import ConfigError, RunConfig
from rawmm.config.duration import DURATION_PATTERN, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("10m", 600), ("1h30m", 5400), ("7d", 604800), ("1d2h3m4s", 93784)]
)
def test_durations_parse(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "1x", "m", "30m1h", "1h 30m", "-1h", "1.5h", " 2h", "2h\n"])
def test_malformed_durations_name_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@given(st.text(st.sampled_from("0123456789dhms \n.-"), max_size=8) | st.from_regex(DURATION_PATTERN))
def test_the_schema_pattern_accepts_exactly_what_the_parser_accepts(text: str) -> None:
    assert parser_agrees_with_pattern(parse_duration, DURATION_PATTERN, text)


def _config(retention: dict[str, object]) -> RunConfig:
    return RunConfig.from_mapping(
        {"model": {"path": "m", "preset": "qwen2_vl"}, "shared_dir": "s", "offload": {"retention": retention}}
    )


def test_retention_is_off_by_default_and_takes_a_duration() -> None:
    assert not _config({}).offload.retention.enabled
    assert _config({"enabled": True, "older_than": "2h"}).offload.retention.older_than_seconds == 7200


@pytest.mark.parametrize(
    ("retention", "message"),
    [
        ({"older_than": "5m"}, "offload.retention.older_than: older-than must be at least 600s"),
        ({"older_than": "soon"}, "offload.retention.older_than: invalid duration"),
        ({"keep_steps": -1}, "offload.retention.keep_steps:"),
    ],
)
def test_a_bad_retention_is_refused_by_field(retention: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(retention)
