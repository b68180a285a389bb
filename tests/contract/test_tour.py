import json
import runpy
import sys
from pathlib import Path

import pytest

TOUR = Path(__file__).resolve().parents[2] / "examples" / "contract_tour.py"


def test_contract_tour_runs_and_prints_consistent_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(TOUR), "--workdir", str(tmp_path)])
    runpy.run_path(str(TOUR), run_name="__main__")
    out = capsys.readouterr().out
    features = json.loads(out.split("request features:", 1)[1])
    assert len(features["mm_hashes"]["image"]) == len(features["mm_placeholders"]["image"]) == 3
    assert len([p for p in (tmp_path / "images").rglob("*") if p.is_file()]) == 3
    assert (tmp_path / "tiny-qwen2-vl" / "config.json").is_file()
