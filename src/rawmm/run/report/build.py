"""Writing the report: the PNGs under `plots/`, and `report.html` holding the same PNGs inline (one file to
send or archive) with the run's headline numbers and a per-step table."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from rawmm.run.report.data import RunRecord, StepRow, load_run
from rawmm.run.report.plots import FIGURES

REPORT_NAME = "report.html"
PLOTS_DIR = "plots"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 62em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { border-bottom: 1px solid #ddd; padding: 0.2em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; } td.key { text-align: left; color: #555; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(30em, 1fr)); gap: 1em; }
figure { margin: 0; } figure img { width: 100%; } figcaption { font-size: 0.85em; color: #555; }
.good { color: #176b2c; font-weight: bold; } .bad { color: #a11; font-weight: bold; }
"""


def build_report(run_dir: Path) -> Path:
    """(Re)write `plots/*.png` and `report.html` in `run_dir`; returns the report's path."""
    record = load_run(Path(run_dir))
    plots = record.run_dir / PLOTS_DIR
    plots.mkdir(exist_ok=True)
    figures = [(title, draw(record, plots / name)) for name, title, draw in FIGURES]
    path = record.run_dir / REPORT_NAME
    staging = path.with_name(f".{REPORT_NAME}.tmp")
    staging.write_text(render_html(record, figures))
    staging.replace(path)  # a browser reloading a live run's report never sees half a file
    return path


def headline(record: RunRecord) -> dict[str, Any]:
    """The numbers a reader looks for first (also what bench/learning.py prints)."""
    above = record.first_above_ceiling()
    summary = record.summary or {}
    return {
        "status": summary.get("status", "running (no summary.json yet)"),
        "steps": f"{len(record.rewards())} of {record.planned_steps}",
        "first reward": _fmt(record.rewards()[0] if record.rewards() else None),
        "mean reward, last 3 steps": _fmt(record.last_mean(3)),
        "blind ceiling": _fmt(record.blind_ceiling),
        "above the ceiling from step": "-" if above is None else str(above.step),
        "... reached after": "-"
        if above is None or above.elapsed_seconds is None
        else f"{above.elapsed_seconds:.0f} s",
        "wall time": "-" if "wall_seconds" not in summary else f"{summary['wall_seconds']:.0f} s",
    }


def render_html(record: RunRecord, figures: list[tuple[str, Path]]) -> str:
    config = record.config
    environment = config.get("orchestrator", {}).get("environment", {})
    title = f"rawmm run {config.get('name', '')}: {record.run_dir.name}"
    facts = {
        "model": f"{config.get('model', {}).get('path')} ({config.get('model', {}).get('preset')})",
        "engine": f"{config.get('inference', {}).get('engine')} x{config.get('inference', {}).get('replicas')}",
        "environment": f"{environment.get('name')} {json.dumps(environment.get('args', {}))}",
        "rollouts per step": _rollouts(config),
        "learning rate": str(config.get("trainer", {}).get("learning_rate")),
        **headline(record),
    }
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _verdict(record),
        "<table>" + "".join(_fact_row(k, v) for k, v in facts.items()) + "</table>",
        "<h2>Plots</h2><div class='figures'>",
        *(_figure(caption, png) for caption, png in figures),
        "</div><h2>Per step</h2>",
        _step_table(record.steps),
        f"<p><small>Rebuild with <code>rawmm report {html.escape(str(record.run_dir))}</code>; "
        f"the PNGs are in <code>{PLOTS_DIR}/</code>.</small></p></body></html>",
    ]
    return "\n".join(parts)


def _verdict(record: RunRecord) -> str:
    last, ceiling = record.last_mean(3), record.blind_ceiling
    if last is None or ceiling is None:
        return ""
    if last > ceiling:
        return (
            f"<p class='good'>The policy beats the blind ceiling: mean reward {last:.3f} over the last 3 "
            f"steps against {ceiling:.3f} for any policy that ignores the pixels.</p>"
        )
    return f"<p class='bad'>Not above the blind ceiling: {last:.3f} over the last 3 steps, ceiling {ceiling:.3f}.</p>"


def _rollouts(config: dict[str, Any]) -> str:
    orchestrator = config.get("orchestrator", {})
    prompts, rollouts = orchestrator.get("prompts_per_step"), orchestrator.get("rollouts_per_prompt")
    return f"{prompts} prompts x {rollouts} rollouts, up to {orchestrator.get('max_turns')} turns"


def _fact_row(key: str, value: str) -> str:
    return f"<tr><td class='key'>{html.escape(key)}</td><td>{html.escape(value)}</td></tr>"


def _figure(caption: str, png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return (
        f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(caption)} ({PLOTS_DIR}/{html.escape(png.name)})</figcaption></figure>"
    )


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "step"),
    ("reward", "reward_mean"),
    ("loss", "loss"),
    ("grad norm", "grad_norm"),
    ("|Δ logprob|", "logprob_diff_mean"),
    ("KL est.", "logprob_kl_mean"),
    ("cache hit rate", "cache_hit_rate"),
    ("rollout s", "rollout_seconds"),
    ("sync s", "sync_seconds"),
    ("materialize s", "materialize_seconds"),
    ("train s", "train_seconds"),
    ("at s", "elapsed_seconds"),
)


def _step_table(rows: list[StepRow]) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in _COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt(getattr(row, attribute))}</td>" for _, attribute in _COLUMNS) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
