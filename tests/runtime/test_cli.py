"""`python -m piper_nb run STRATEGY.json ...`: compile, train beside the reference, write
the measured timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import piper_nb as pn
from piper_nb.__main__ import load_user_model, main, stage_count

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
    assert "dev1 pp" in html and "r1:F0" in html
    saved = json.loads((out / "losses.json").read_text())
    assert saved["losses"] == pytest.approx(saved["reference"], abs=1e-5)
    assert (out / "plan.txt").read_text().startswith("dev0")


def test_cli_reports_plan_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"op": "place", "filter": {"PP": 0}, "devices": [0]}, {"op": "nope"}]')
    assert main(["run", str(bad), "--model", "mlp", "--devices", "1", "--out",
                 str(tmp_path / "o")]) == 2
    assert "unknown op" in capsys.readouterr().err


USER_MODULE = '''
import piper_nb as pn


def build():
    m = pn.models.MLP(dim=8, depth=2)
    return m, m.example_batch(batch_size=8, seed=0)


def build_with_loss():
    m, batch = build()
    return m, batch, lambda out, target: (out - target).abs().mean()


def wrong_count():
    return build()[0]


def wrong_batch():
    m, (x, y) = build()
    return m, [x, y, y]


def no_loss():
    import torch
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    return m, (torch.zeros(8, 8), torch.zeros(8, 8))


def hf_llama():
    """A Hugging Face model with a dict batch and no loss_fn: its own loss from the labels
    (token ids, pad/bos/eos among them, inside the tiny vocabulary)."""
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def piped():
    """A model written for torch.distributed.pipelining: pipe_split() in its forward."""
    import torch
    from torch.distributed.pipelining import pipe_split

    class Piped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            x = torch.tanh(self.a(x))
            pipe_split()
            return self.b(x)

    torch.manual_seed(0)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    return Piped(), (x, x.flip(0)), lambda out, y: ((out - y) ** 2).mean()


def needs_args(size):
    return build()


not_callable = 3
'''


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_cli_runs_a_user_model_function(tmp_path):
    """`--model mymod:build` imports mymod from the current directory, in a real subprocess."""
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "piper_nb", "run", str(EXAMPLES / "pp2_1f1b.json"),
                           "--model", "mymod:build", "--devices", "2", "--steps", "2",
                           "--optimizer", "sgd", "--lr", "0.1", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]
    for _, loss, ref, diff, _ in rows:
        assert float(loss) == pytest.approx(float(ref), abs=1e-5) and float(diff) < 1e-5
    assert float(rows[1][1]) < float(rows[0][1])  # it trains
    for name in ("timeline.html", "trace.json", "plan.txt", "losses.json"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "losses.json").read_text())
    assert saved["losses"] == pytest.approx(saved["reference"], abs=1e-5)
    # the batch is the user's own: 8 samples over 4 microbatches of the 1F1B example
    assert (out / "plan.txt").read_text().startswith("dev0")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A uniquely named user module in tmp_path, the working directory; sys.path restored."""
    name = f"user_model_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def _exit_message(argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return str(info.value)


def test_load_user_model_imports_from_the_working_directory(user_module):
    model, batch, loss_fn = load_user_model(f"{user_module}:build")
    assert isinstance(model, pn.models.MLP) and loss_fn is None
    assert [tuple(t.shape) for t in batch] == [(8, 8), (8, 8)]
    model, batch, loss_fn = load_user_model(f"{user_module}:build_with_loss")
    assert float(loss_fn(batch[1], batch[1])) == 0.0


@pytest.mark.parametrize("target, expected", [
    ("no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
    ("no_such_pkg_xyz.mod:build", "no module named 'no_such_pkg_xyz'"),
    ("{mod}:missing", "has no 'missing'"),
    ("{mod}:not_callable", "is not callable (int); name a function returning (model, batch) or (model, "),
    ("{mod}:needs_args", "must be callable with no arguments"),
    ("{mod}:wrong_count", "must return (model, batch) or (model, batch, loss_fn), got MLP"),
    ("{mod}:wrong_batch", "batch an (inputs, targets) pair of tensors or a dict of tensors, got a 3-list"),
    ("{mod}:no_loss", "has no loss_fn method; return (model, batch, loss_fn)"),
    ("{mod}:", "expected package.module:function"),
])
def test_cli_user_model_errors_name_what_was_expected(user_module, tmp_path, target, expected):
    message = _exit_message(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model",
                             target.format(mod=user_module), "--out", str(tmp_path / "o")])
    assert expected in message
    assert not (tmp_path / "o").exists()


@pytest.mark.dist
def test_cli_runs_a_dict_batch_with_the_models_own_loss_and_prints_the_cut(
        user_module, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    code = main(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model", f"{user_module}:hf_llama",
                 "--stages", "2", "--devices", "2", "--steps", "2", "--optimizer", "sgd",
                 "--lr", "0.1", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "the cut:\n  PP=0: model.embed_tokens, model.layers.0\n" in text
    assert "  PP=1: model.layers.1, model.norm, lm_head\n" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[3]) < 1e-5 for r in rows)
    plan = (out / "plan.txt").read_text()
    assert plan.startswith("dev0") and '"lm_head": {\n  "PP": 1' in plan


@pytest.mark.dist
def test_cli_keeps_the_models_own_pipe_split_cut(user_module, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model", f"{user_module}:piped",
                 "--devices", "2", "--steps", "2", "--optimizer", "sgd", "--lr", "0.1",
                 "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "the cut:\n  the model's own pipe_split() calls\n" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[3]) < 1e-5 for r in rows)
    message = _exit_message(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model",
                             f"{user_module}:piped", "--stages", "3", "--out", str(out)])
    assert "makes 1 pipe_split() call, so it has 2 stages" in message


@pytest.mark.dist
def test_cli_takes_an_annotation_file(tmp_path, capsys):
    tags = tmp_path / "tags.json"
    tags.write_text('{"layers.0": {"PP": 0}, "layers.[1-3]": {"PP": 1}}')   # uneven, on purpose
    code = main(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model", "mlp", "--annotations",
                 str(tags), "--steps", "1", "--batch-size", "8", "--out", str(tmp_path / "o")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "  PP=0: layers.0\n  PP=1: layers.[1-3]\n" in text
    tags.write_text('["layers.0"]')
    message = _exit_message(["run", str(EXAMPLES / "pp2_1f1b.json"), "--model", "mlp",
                             "--annotations", str(tags), "--out", str(tmp_path / "o")])
    assert "expected a mapping from module patterns to tags" in message
    with pytest.raises(SystemExit):
        main(["run", str(EXAMPLES / "pp2_1f1b.json"), "--stages", "2", "--annotations", str(tags)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_rejects_builtin_only_flags_and_unknown_names(user_module, tmp_path, capsys):
    strategy = str(EXAMPLES / "pp2_1f1b.json")
    for flags in (["--batch-size", "8"], ["--tied"]):
        with pytest.raises(SystemExit) as info:
            main(["run", strategy, "--model", f"{user_module}:build", *flags])
        assert info.value.code == 2
        assert f"{flags[0]} applies to the built-in models only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["run", strategy, "--model", "resnet"])
    assert info.value.code == 2
    assert "choose one of tiny_gpt, mlp, tiny_moe or name your own" in capsys.readouterr().err


def test_cli_help_documents_user_models(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "package.module:function" in text and "(model, batch, loss_fn)" in text
    assert "defaults to model.loss_fn" in text
    assert "(default: tiny_gpt)" in text and "(default: 2)" in text and "(default: 16)" in text
