"""`python -m piper_nb run STRATEGY.json ...`: compile, train beside the reference, write
the measured timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import piper_nb as pn
from piper_nb.__main__ import main, stage_count

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_stage_count_reads_filters_and_schedules():
    program = pn.Program.from_json((EXAMPLES / "pp2_dp2_zero3.json").read_text())
    assert stage_count(program) == 2
    assert stage_count(pn.Program([{"op": "split", "filter": {}, "num_microbatches": 2}])) == 1
    assert stage_count(pn.Program([{"op": "schedule", "name": "interleaved_1f1b", "ranks": 2,
                                    "microbatches": 4, "chunks": 2}])) == 4


@pytest.mark.dist
def test_cli_run_writes_timeline(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model", "mlp", "--devices", "2",
                 "--steps", "2", "--batch-size", "8", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(float(r[3]) < 1e-5 for r in rows)  # |loss - reference|
    html = (out / "timeline.html").read_text()
    assert "dev1 pp" in html and "1F0" in html
    saved = json.loads((out / "losses.json").read_text())
    assert saved["losses"] == pytest.approx(saved["reference"], abs=1e-5)
    assert (out / "plan.txt").read_text().startswith("dev0")


def test_cli_reports_plan_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"op": "place", "filter": {"PP": 0}, "devices": [0]}, {"op": "nope"}]')
    assert main(["run", str(bad), "--model", "mlp", "--devices", "1", "--out",
                 str(tmp_path / "o")]) == 2
    assert "unknown op" in capsys.readouterr().err
