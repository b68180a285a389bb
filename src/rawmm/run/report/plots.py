"""The report's figures (matplotlib, Agg backend): one PNG per question a reader asks of a run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rawmm.run.report.data import RunRecord, StepRow

FIGSIZE = (7.0, 3.2)
DPI = 110


def _series(
    rows: Sequence[StepRow], value: Callable[[StepRow], float | None]
) -> tuple[list[int], list[float]]:
    points = [(row.step, v) for row in rows if (v := value(row)) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe in a process that imported pyplot elsewhere
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_xlabel("step")
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return path


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def reward(record: RunRecord, path: Path) -> Path:
    fig, ax = _figure()
    steps, values = _series(record.steps, lambda r: r.reward_mean)
    ax.plot(steps, values, marker="o", markersize=3, label="mean reward")
    if record.blind_ceiling is not None:
        ax.axhline(
            record.blind_ceiling,
            color="grey",
            linestyle="--",
            label=f"blind ceiling {record.blind_ceiling:.3g}",
        )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("reward")
    ax.set_title("Reward per step (rollouts of the step)")
    ax.legend(loc="best", fontsize="small")
    _integer_steps(ax)
    return _save(fig, path)


def reward_by_label(record: RunRecord, path: Path) -> Path:
    fig, ax = _figure()
    labels = sorted({label for row in record.steps for label in row.reward_by_label})
    for label in labels:

        def score(row: StepRow, label: str = label) -> float | None:
            return row.reward_by_label.get(label)

        steps, values = _series(record.steps, score)
        ax.plot(steps, values, marker="o", markersize=3, label=label)
    if not labels:
        ax.text(0.5, 0.5, "the environment reports no answer labels", ha="center", transform=ax.transAxes)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("score")
    ax.set_title("Score per answer (mean over the step's replies asking for it)")
    if labels:
        ax.legend(loc="best", fontsize="small", ncol=min(4, len(labels)))
    _integer_steps(ax)
    return _save(fig, path)


class _Curve(NamedTuple):
    """One quantity per step on one y axis of a two-scale figure."""

    value: Callable[[StepRow], float | None]
    label: str
    axis_label: str
    colour: str


def _plot_curve(ax: Any, record: RunRecord, curve: _Curve, marker: str) -> None:
    steps, values = _series(record.steps, curve.value)
    ax.plot(steps, values, marker=marker, markersize=3, color=curve.colour, label=curve.label)
    ax.set_ylabel(curve.axis_label, color=curve.colour)


def _two_scales(record: RunRecord, left: _Curve, right: _Curve) -> tuple[Any, Any, Any]:
    """A figure of two quantities of different scales per step: `left` on the left axis, `right` on a
    second y axis; returns the figure and both axes."""
    fig, ax = _figure()
    _plot_curve(ax, record, left, "o")
    twin = ax.twinx()
    _plot_curve(twin, record, right, "s")
    return fig, ax, twin


def loss_and_grad_norm(record: RunRecord, path: Path) -> Path:
    fig, ax, right = _two_scales(
        record,
        _Curve(lambda r: r.loss, "loss", "loss", "tab:blue"),
        _Curve(lambda r: r.grad_norm, "grad norm (before clip)", "grad norm (before clipping)", "tab:orange"),
    )
    right.set_ylim(bottom=0)
    ax.set_title("Policy-gradient loss and gradient norm")
    _integer_steps(ax)
    return _save(fig, path)


def logprob_mismatch(record: RunRecord, path: Path) -> Path:
    fig, ax, right = _two_scales(
        record,
        _Curve(lambda r: r.logprob_diff_mean, "mean |Δ logprob|", "mean |Δ logprob|", "tab:purple"),
        _Curve(lambda r: r.logprob_kl_mean, "KL estimate (k3)", "KL(engine ‖ trainer), k3", "tab:green"),
    )
    for axis in (ax, right):
        axis.set_ylim(bottom=0)
        axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_title("Engine vs trainer logprobs of the sampled tokens")
    _integer_steps(ax)
    return _save(fig, path)


def cache_hit_rate(record: RunRecord, path: Path) -> Path:
    fig, ax = _figure()
    steps, values = _series(record.steps, lambda r: r.cache_hit_rate)
    ax.plot(steps, [100 * v for v in values], marker="o", markersize=3, color="tab:cyan")
    if not steps:
        ax.text(0.5, 0.5, "no engine cache counters recorded", ha="center", transform=ax.transAxes)
    ax.set_ylim(0, 100)
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Engine materialize-cache hit rate per step")
    _integer_steps(ax)
    return _save(fig, path)


STEP_PARTS: tuple[tuple[str, str, str], ...] = (
    ("rollout_seconds", "rollouts", "tab:blue"),
    ("sync_seconds", "weight sync", "tab:red"),
    ("materialize_seconds", "trainer materialization", "tab:olive"),
    ("train_seconds", "training + checkpoint", "tab:orange"),
)


def step_time(record: RunRecord, path: Path) -> Path:
    fig, ax = _figure()
    rows = record.steps
    bottoms = [0.0] * len(rows)
    for attribute, label, colour in STEP_PARTS:
        values = [getattr(row, attribute) or 0.0 for row in rows]
        ax.bar([row.step for row in rows], values, bottom=bottoms, label=label, color=colour, width=0.8)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("seconds")
    ax.set_title("Where a step's time goes")
    ax.legend(loc="best", fontsize="small")
    _integer_steps(ax)
    return _save(fig, path)


FIGURES: tuple[tuple[str, str, Callable[[RunRecord, Path], Path]], ...] = (
    ("reward.png", "Reward", reward),
    ("reward_by_answer.png", "Reward per answer", reward_by_label),
    ("loss_grad_norm.png", "Loss and gradient norm", loss_and_grad_norm),
    ("logprob_mismatch.png", "Engine-trainer logprob mismatch", logprob_mismatch),
    ("cache_hit_rate.png", "Cache hit rate", cache_hit_rate),
    ("step_time.png", "Step time split", step_time),
)
