"""The run report: `report.html` (self-contained) and PNG plots in a run's output directory.

`rawmm run` writes it when a run ends; `rawmm report RUN_DIR` rebuilds it from what the run left on
disk at any time, live or finished: the step lines of the orchestrator's and trainer's logs, the
engine-cache timeline `rawmm run` appends to (`timeline.jsonl`) and `summary.json` when there is one.
"""

from rawmm.run.report.build import REPORT_NAME, build_report
from rawmm.run.report.data import RunRecord, load_run

__all__ = ["REPORT_NAME", "RunRecord", "build_report", "load_run"]
