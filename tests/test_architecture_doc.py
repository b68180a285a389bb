"""docs/architecture.md stays true to the code: its list of error reasons is the contract's, and it names
every exported metric the code defines and no other."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from rawmm.contract.errors import REASONS

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text()
# The modules that define the exported metrics of the engine, trainer, orchestrator and operator.
METRIC_MODULES = [
    "src/rawmm/materialize/metrics.py",
    "src/rawmm/serving/metrics.py",
    "src/rawmm/rl/orchestrator/metrics.py",
    "src/rawmm/rl/trainer/metrics.py",
    "src/rawmm/rl/retention/metrics.py",
    "operator/rawmm_operator/metrics.py",
]


def defined_metrics() -> set[str]:
    """Metric family names as the code spells them (prometheus-client adds `_total` to counters)."""
    names: set[str] = set()
    for module in METRIC_MODULES:
        source = (REPO / module).read_text()
        names |= set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"(rawmm_[a-z_]+)"', source))
    return names


def documented_metrics() -> set[str]:
    """`rawmm_…` names in the doc: `{a,b}` groups inside a name expanded, a trailing `{label}` and `_total`
    dropped."""
    names: set[str] = set()
    metrics_section = DOC[DOC.index("## 8. Metrics") :]
    for token in re.findall(r"`(rawmm_[a-z_{},]+)", metrics_section):
        parts = re.split(r"\{([a-z_,]+)\}", re.sub(r"\{[a-z_,]+\}$", "", token))
        choices = [part.split(",") if i % 2 else [part] for i, part in enumerate(parts)]
        for combination in itertools.product(*choices):
            names.add("".join(combination).removesuffix("_total"))
    return names


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    defined = defined_metrics()
    assert len(defined) > 20
    assert defined == documented_metrics()


def test_every_error_reason_is_in_the_list_of_reasons() -> None:
    section = DOC[DOC.index("### 3.5 Error reasons") : DOC.index("## 4.")]
    assert re.findall(r"`([a-z_]+)`", section.split(":", 1)[1].split(".", 1)[0]) == list(REASONS)
