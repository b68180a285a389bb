"""manifests/generate.py as a module, for the chart and monitoring tests: the generated files and the
tests see one rendering of the chart. A module of its own: conftest.py is not for importing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

GENERATE_PY = Path(__file__).resolve().parents[1] / "manifests" / "generate.py"


def load_generate() -> ModuleType:
    """manifests/generate.py, loaded once per session."""
    name = "rawmm_chart_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GENERATE_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
    return sys.modules[name]
