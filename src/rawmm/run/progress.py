"""The live view of a local run (rich), refreshed from the processes' metrics and step lines.

Two small tables, because the loop and the engines report different things: the orchestrator and
the trainer (status, step, reward, loss, what the step handled) and the engine replicas (status,
cache hit rate, invalid refs, weights version). Both fit an 80-column console without wrapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table

from rawmm.run.processes import ChildProcess
from rawmm.run.state import RunState


def _status(child: ChildProcess | None) -> str:
    if child is None:
        return "external"
    code = child.poll()
    if child.popen is None:
        return "[dim]waiting[/]"
    if code is None:
        return "[green]running[/]"
    return "[blue]done[/]" if code == 0 else f"[red]exited {code}[/]"


def _num(value: float | None, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(
        *columns, title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
        padding=(0, 1), collapse_padding=True, pad_edge=False,
    )  # fmt: skip
    for column in table.columns:
        column.no_wrap = True
    return table


def _loop_table(state: RunState, by_name: dict[str, ChildProcess], *, title: str) -> Table:
    table = _table("process", "status", "step", "reward", "loss", "detail", title=title)
    last = state.orchestrator_steps.get(max(state.orchestrator_steps, default=0), {})
    dropped = sum(state.samples_dropped.values())
    table.add_row(
        "orchestrator",
        _status(by_name.get("orchestrator")),
        str(last.get("step", "-")),
        _num(last.get("reward_mean")),
        "-",
        f"{last.get('rollouts', 0)} rollouts, {dropped} dropped",
    )
    trainer = state.trainer_steps.get(max(state.trainer_steps, default=0), {})
    table.add_row(
        "trainer",
        _status(by_name.get("trainer")),
        str(trainer.get("step", "-")),
        _num(trainer.get("reward_mean")),
        _num(trainer.get("loss"), "{:.3g}"),
        f"{trainer.get('images_materialized', 0)} images, {trainer.get('missing_images', 0)} missing",
    )
    return table


def _engine_table(state: RunState, by_name: dict[str, ChildProcess]) -> Table:
    table = _table("engine", "status", "cache hit rate", "invalid refs", "weights")
    for i, url in enumerate(state.engine_urls):
        scrape = state.engines.get(url)
        child = by_name.get(f"engine-{i}")
        hits = scrape.total("rawmm_materialize_cache_hits_total") if scrape else None
        misses = scrape.total("rawmm_materialize_cache_misses_total") if scrape else None
        rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
        version = scrape.value("rawmm_engine_weights_version") if scrape else None
        table.add_row(
            f"engine :{url.rsplit(':', 1)[-1]}" if child else url,
            _status(child),
            _num(rate, "{:.0%}"),
            _num(scrape.total("rawmm_invalid_mm_image_ref_total") if scrape else None, "{:.0f}"),
            _num(version, "v{:.0f}"),
        )
    return table


def render(state: RunState, children: Sequence[ChildProcess], *, steps: int, elapsed_s: float) -> Group:
    trained = max(state.trainer_steps, default=0)
    by_name = {child.name: child for child in children}
    title = f"rawmm run: step {trained}/{steps}, {elapsed_s:.0f}s"
    return Group(_loop_table(state, by_name, title=title), "", _engine_table(state, by_name))


def step_line(event: dict) -> str:
    """A one-line log of a step event (key=value, under 80 columns at the demo's sizes), for consoles that are
    not terminals."""
    if event["event"] == "orchestrator_step":
        dropped = event["dropped"]
        reasons = f" ({', '.join(f'{r}={n}' for r, n in sorted(dropped.items()))})" if dropped else ""
        return (
            f"orchestrator step {event['step']}: reward={event['reward_mean']:.4g} rollouts={event['rollouts']} "
            f"dropped={sum(dropped.values())}{reasons} samples={event['samples']} "
            f"image_refs={event['images_sent']}"
        )
    return (
        f"trainer step {event['step']}: loss={event['loss']:.4g} grad_norm={event['grad_norm']:.3g} "
        f"tokens={event['tokens']} images={event['images_materialized']} missing={event['missing_images']}"
    )


def outcome(summary: dict[str, Any]) -> str:
    """The end-of-run report of a completed run: totals, then the per-step numbers in columns."""
    rate = summary["cache_hit_rate"]
    rows = [
        ("reward per step", summary["reward_mean"]),
        ("loss per step", summary["loss"]),
        ("grad norm per step", summary["grad_norm"]),
    ]
    lines = [
        f"done: {summary['steps_completed']} steps in {summary['wall_seconds']:.0f}s, cache hit rate "
        f"{_num(rate, '{:.0%}')}, invalid refs {summary['invalid_mm_image_refs']}"
    ]
    lines += [f"  {label:<19}" + "".join(f"{value:>11.4g}" for value in values) for label, values in rows]
    return "\n".join(lines)
