"""The live view of a local run (rich): one row per process, refreshed from its metrics and step lines."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from rawmm.run.processes import ChildProcess
from rawmm.run.state import RunState


def _status(child: ChildProcess) -> str:
    code = child.poll()
    if child.popen is None:
        return "[dim]waiting[/]"
    if code is None:
        return "[green]running[/]"
    return "[blue]done[/]" if code == 0 else f"[red]exited {code}[/]"


def _num(value: float | None, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def render(state: RunState, children: Sequence[ChildProcess], *, steps: int, elapsed_s: float) -> Table:
    trained = max(state.trainer_steps, default=0)
    table = Table(title=f"rawmm run: step {trained}/{steps}, {elapsed_s:.0f}s", title_justify="left")
    for column in ("process", "status", "step", "reward", "loss", "cache hit rate", "invalid refs", "detail"):
        table.add_column(column)
    by_name = {child.name: child for child in children}
    for i, url in enumerate(state.engine_urls):
        scrape = state.engines.get(url)
        child = by_name.get(f"engine-{i}")
        hits = scrape.total("rawmm_materialize_cache_hits_total") if scrape else None
        misses = scrape.total("rawmm_materialize_cache_misses_total") if scrape else None
        rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
        table.add_row(
            f"engine {url.rsplit(':', 1)[-1]}" if child else url,
            _status(child) if child else "external",
            "-",
            "-",
            "-",
            _num(rate, "{:.0%}"),
            _num(scrape.total("rawmm_invalid_mm_image_ref_total") if scrape else None, "{:.0f}"),
            f"weights v{_num(scrape.value('rawmm_engine_weights_version') if scrape else None, '{:.0f}')}",
        )
    last = state.orchestrator_steps.get(max(state.orchestrator_steps, default=0), {})
    dropped = sum(state.samples_dropped.values())
    table.add_row(
        "orchestrator",
        _status(by_name["orchestrator"]) if "orchestrator" in by_name else "-",
        str(last.get("step", "-")),
        _num(last.get("reward_mean")),
        "-",
        "-",
        "-",
        f"{last.get('rollouts', 0)} rollouts, {dropped} dropped",
    )
    trainer = state.trainer_steps.get(trained, {})
    table.add_row(
        "trainer",
        _status(by_name["trainer"]) if "trainer" in by_name else "-",
        str(trainer.get("step", "-")),
        _num(trainer.get("reward_mean")),
        _num(trainer.get("loss")),
        "-",
        "-",
        f"{trainer.get('images_materialized', 0)} images materialized, {trainer.get('missing_images', 0)} missing",
    )
    return table


def step_line(event: dict) -> str:
    """A one-line log of a step event, for consoles that are not terminals."""
    if event["event"] == "orchestrator_step":
        return (
            f"orchestrator step {event['step']}: reward {event['reward_mean']:.3f}, {event['rollouts']} rollouts, "
            f"{event['samples']} samples, {event['images_sent']} image refs sent, dropped {event['dropped']}"
        )
    return (
        f"trainer step {event['step']}: loss {event['loss']:.6g}, {event['tokens']} tokens, "
        f"{event['images_materialized']} images materialized, {event['missing_images']} missing"
    )
