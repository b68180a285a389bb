"""Reading the run's Prometheus endpoints (engines, orchestrator, trainer) into plain numbers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One scrape of one endpoint: sample name -> {sorted label pairs -> value}."""

    samples: Mapping[str, Mapping[Labels, float]]

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get(name, {}).get(tuple(sorted(labels.items())))

    def total(self, name: str) -> float:
        """Sum over every label set of `name` (0 when absent)."""
        return sum(self.samples.get(name, {}).values())


def parse_metrics(text: str) -> Scrape:
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return Scrape(samples)


def scrape(client: httpx.Client, url: str) -> Scrape | None:
    """The endpoint's metrics, or None if it does not answer right now."""
    try:
        response = client.get(url)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    try:
        return parse_metrics(response.text)
    except ValueError:  # something else answers on the port (a proxy's page): no metrics from it now
        return None


def health_version(client: httpx.Client, base_url: str) -> int | None:
    """An engine replica's weights version from `/health`, or None if it is not healthy."""
    try:
        response = client.get(f"{base_url}/health")
        response.raise_for_status()
        return int(response.json()["weights_version"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
