"""`rawmm run`: engines, orchestrator and trainer as local processes on one shared directory."""

from rawmm.run.local import LocalRun, LocalRunFailed
from rawmm.run.plan import LocalRunPlan, PlanError, plan_local_run

__all__ = ["LocalRun", "LocalRunFailed", "LocalRunPlan", "PlanError", "plan_local_run"]
