"""Reading a run's Prometheus endpoints and an engine's /health (`rawmm.run.scrape`), against answers that
an `httpx.MockTransport` gives (no server, no port)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from rawmm.run.scrape import Scrape, health_version, parse_metrics, scrape

EXPOSITION = """\
# HELP rawmm_materialize_cache_hits_total Cache hits.
# TYPE rawmm_materialize_cache_hits_total counter
rawmm_materialize_cache_hits_total 30.0
# HELP rawmm_invalid_mm_image_ref_total Invalid refs.
# TYPE rawmm_invalid_mm_image_ref_total counter
rawmm_invalid_mm_image_ref_total{reason="missing_file",side="engine"} 2.0
rawmm_invalid_mm_image_ref_total{side="engine",reason="hash_mismatch"} 3.0
# HELP rawmm_engine_weights_version Weights version.
# TYPE rawmm_engine_weights_version gauge
rawmm_engine_weights_version 4.0
# HELP rawmm_rollout_seconds Rollout time.
# TYPE rawmm_rollout_seconds histogram
rawmm_rollout_seconds_bucket{le="1.0"} 1.0
rawmm_rollout_seconds_bucket{le="+Inf"} 2.0
rawmm_rollout_seconds_count 2.0
rawmm_rollout_seconds_sum 3.5
"""


def client(answer: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(answer))


def test_samples_are_found_by_name_and_labels_in_any_order() -> None:
    found = parse_metrics(EXPOSITION)
    assert found.value("rawmm_materialize_cache_hits_total") == 30
    assert found.value("rawmm_engine_weights_version") == 4
    assert found.value("rawmm_invalid_mm_image_ref_total", side="engine", reason="hash_mismatch") == 3
    assert found.value("rawmm_invalid_mm_image_ref_total", reason="missing_file", side="engine") == 2
    assert found.value("rawmm_rollout_seconds_bucket", le="+Inf") == 2
    assert found.value("rawmm_rollout_seconds_sum") == 3.5


def test_a_value_needs_every_label_of_its_sample() -> None:
    found = parse_metrics(EXPOSITION)
    assert found.value("rawmm_invalid_mm_image_ref_total") is None
    assert found.value("rawmm_invalid_mm_image_ref_total", reason="missing_file") is None
    assert found.value("rawmm_materialize_cache_hits_total", side="engine") is None
    assert found.value("rawmm_absent") is None


def test_a_total_sums_every_label_set_and_is_zero_when_absent() -> None:
    found = parse_metrics(EXPOSITION)
    assert found.total("rawmm_invalid_mm_image_ref_total") == 5
    assert found.total("rawmm_materialize_cache_hits_total") == 30
    assert found.total("rawmm_absent") == 0
    assert parse_metrics("") == Scrape({})


def test_scrape_reads_the_endpoint() -> None:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(200, text=EXPOSITION)

    with client(answer) as http:
        found = scrape(http, "http://engine:8000/metrics")
    assert asked == ["http://engine:8000/metrics"]
    assert found == parse_metrics(EXPOSITION)


@pytest.mark.parametrize(
    "answer",
    [
        lambda request: httpx.Response(503, text=EXPOSITION),
        lambda request: httpx.Response(404),
        lambda request: (_ for _ in ()).throw(httpx.ConnectError("connection refused", request=request)),
        lambda request: (_ for _ in ()).throw(httpx.ReadTimeout("timed out", request=request)),
    ],
    ids=["unavailable", "not found", "refused", "timeout"],
)
def test_an_endpoint_that_does_not_answer_now_scrapes_as_none(
    answer: Callable[[httpx.Request], httpx.Response],
) -> None:
    with client(answer) as http:
        assert scrape(http, "http://engine:8000/metrics") is None


def test_an_endpoint_that_answers_something_else_than_metrics_scrapes_as_none() -> None:
    with client(lambda request: httpx.Response(200, text="<html>a proxy's page</html>")) as http:
        assert scrape(http, "http://engine:8000/metrics") is None


def test_health_version_is_the_engines_weights_version() -> None:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(200, json={"status": "ok", "weights_version": 7})

    with client(answer) as http:
        assert health_version(http, "http://engine:8000") == 7
    assert asked == ["http://engine:8000/health"]


@pytest.mark.parametrize(
    "answer",
    [
        lambda request: httpx.Response(503, json={"status": "starting", "weights_version": 0}),
        lambda request: httpx.Response(200, text="not json"),
        lambda request: httpx.Response(200, json={"status": "ok"}),
        lambda request: httpx.Response(200, json={"status": "ok", "weights_version": None}),
        lambda request: httpx.Response(200, json={"status": "ok", "weights_version": "seven"}),
        lambda request: httpx.Response(200, json=["weights_version"]),
        lambda request: (_ for _ in ()).throw(httpx.ConnectError("connection refused", request=request)),
    ],
    ids=["unavailable", "not json", "no version", "null version", "not a number", "a list", "refused"],
)
def test_an_engine_that_is_not_healthy_has_no_version(
    answer: Callable[[httpx.Request], httpx.Response],
) -> None:
    with client(answer) as http:
        assert health_version(http, "http://engine:8000") is None
