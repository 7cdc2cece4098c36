"""`python -m piper_nb search`: the table, the best program written as Piper JSON with its
stage cut, which `python -m piper_nb run` then trains like one process; bad pins and
models are errors that name the fix."""

from __future__ import annotations

import json

import pytest

import piper_nb as pn
from piper_nb.__main__ import main


def test_search_writes_the_best_program_and_run_trains_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "best.json"
    assert main(["search", "--model", "tiny_gpt", "--devices", "2", "--batch-size", "8",
                 "--precision", "fp32", "--pin", "pp=2", "--pin", "schedule=1f1b,gpipe",
                 "--verify", "2", "--top", "2", "--sort", "tokens", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "candidates explored" in text and "tok/s/dev" in text
    pn.Program.from_json(out.read_text())   # Piper's JSON, read back
    assert {"place", "split", "order"} <= {d["op"] for d in json.loads(out.read_text())}
    cut = json.loads(out.with_suffix(".annotations.json").read_text())
    assert {tags["PP"] for tags in cut.values()} == {0, 1}
    assert "train it: python -m piper_nb run" in text
    assert main(["run", str(out), "--model", "tiny_gpt", "--annotations",
                 str(out.with_suffix(".annotations.json")), "--devices", "2",
                 "--batch-size", "8", "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    losses = json.loads((tmp_path / "run" / "losses.json").read_text())
    assert losses["losses"] == pytest.approx(losses["reference"], rel=1e-5)


def test_a_bad_pin_is_an_error_that_names_the_knobs(capsys):
    assert main(["search", "--model", "tiny_gpt", "--devices", "2", "--pin", "stages=2"]) == 2
    assert "the knobs are pp, tp, dp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["search", "--model", "gpt5", "--devices", "2"])
    assert "llama3-70b" in capsys.readouterr().err
