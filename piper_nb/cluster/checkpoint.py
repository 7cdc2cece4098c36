"""Checkpoints of a training run: written atomically (DCP directories, or piper_nb's own file).

`pn.train(..., checkpoint_dir=d, checkpoint_every=K)` writes `d/step-000012/` (PyTorch's
distributed checkpoint, `cluster.dcp`, which resumes on any plan of the same model) every
K steps and after the last one; with `checkpoint_format="piper_nb"`, `d/step-000012.pt`
(the format below, which resumes on the plan that wrote it); `resume=True` continues from
the newest checkpoint in `d` (a file of the old format resumes, with a note). A checkpoint
holds the whole training state at a step boundary: every rank's parameters
(full, or its ZeRO-3 shards) and optimizer state with the step count (what the workers'
`train_state` reports), the number of batches consumed (a loader is advanced past them on
resume), the losses and step times so far, and what wrote it: a fingerprint of the captured
model, the plan, the optimizer and the scheduler (`cluster.fingerprint`), so a resumed run
ends bit for bit where an uninterrupted one would, and a resume where any of them changed is
refused, naming the change (a DCP checkpoint: the plan may differ). `resume="weights_only"`
loads the parameters and buffers anyway and starts the optimizer and scheduler fresh at the
checkpoint's step.

A DCP checkpoint is written into a hidden temporary directory and renamed (`save_dcp`). A
file is written to a temporary name in the same directory, flushed, fsynced and then
renamed over its final name (`os.replace`, atomic on POSIX and Windows), and the directory
is fsynced: a crash mid-write leaves the previous checkpoint intact and no torn file under
a checkpoint's name. Files are read with `torch.load(weights_only=True)`: tensors, numbers,
strings and containers only, so a checkpoint from elsewhere cannot run code. The newest
`keep` checkpoints are kept.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from piper_nb.cluster import dcp
from piper_nb.cluster.fingerprint import (
    differences,
    fingerprint,
    model_changes,
    plan_fingerprint,
    whole_model,
)
from piper_nb.errors import PlanError, RuntimeFailure
from piper_nb.metrics import StepMetrics
from piper_nb.optim import check_optimizer

__all__ = ["FORMAT", "RESUME", "Checkpointer", "save", "load", "latest", "checkpoints",
           "plan_fingerprint", "full_state"]

FORMAT = "piper_nb.checkpoint/1"
DCP_FORMAT = "piper_nb.dcp/1"
_NAME = re.compile(r"^step-(\d{6,})(\.pt)?$")
RESUME = (False, True, "weights_only")   # what `pn.train(resume=...)` takes
FORMATS = ("dcp", "piper_nb")            # what `pn.train(checkpoint_format=...)` takes


def checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))
             and (m.group(2) or dcp.is_dcp(p))]
    return sorted(found)


def latest(directory: str | os.PathLike) -> Path | None:
    found = checkpoints(directory)
    return found[-1][1] if found else None


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its rename is durable enough
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(obj: dict, fh) -> None:
    """Serialize `obj` into the open file `fh` (a seam for tests that cut a write short)."""
    torch.save(obj, fh)


def save(directory: str | os.PathLike, obj: dict, keep: int | None = 2) -> Path:
    """Write checkpoint `obj` (with an int `step`) atomically; drop all but the newest `keep`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{obj['step']:06d}.pt"
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            _write(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(d)
    _drop_old(d, keep)
    return final


def _drop_old(d: Path, keep: int | None) -> None:
    if keep is not None:
        for _, old in checkpoints(d)[:-keep]:
            shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)


def save_dcp(directory: str | os.PathLike, plan, spec, states: list[dict], sidecar: dict,
             keep: int | None = 2) -> Path:
    """Write a DCP checkpoint (`cluster.dcp`) atomically: into a temporary directory beside
    it, fsynced, then renamed to `step-000012/` (a directory left by a write that was cut
    short, or killed, is removed by the next one and never read)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = d / f"step-{sidecar['step']:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=d))
    try:
        dcp.write(tmp, plan, spec, states, sidecar["step"], sidecar)
        _fsync_dir(tmp)
        if final.exists():               # the same step again, after a restart
            gone = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=d))
            os.replace(final, gone / final.name)
            shutil.rmtree(gone)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(d)
    _drop_old(d, keep)
    return final


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint with `weights_only=True`; raise RuntimeFailure naming a bad file."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise RuntimeFailure(f"cannot read checkpoint {path}: {err}", original=str(err)) from err
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise RuntimeFailure(f"{path} is not a piper_nb checkpoint (format {FORMAT})")
    return obj


def full_state(obj: dict, plan) -> dict[str, torch.Tensor]:
    """Canonical parameter name -> full tensor, assembled from a checkpoint's ranks."""
    from piper_nb.runtime.layout import assemble_state
    return assemble_state(plan, obj["workers"])


class Checkpointer:
    """What `pn.train` calls: `restore(cluster, steps)` after `reset`, `after_step(...)` per
    step."""

    def __init__(self, plan, optimizer, directory: str | os.PathLike, every: int | None = None,
                 resume: bool | str = False, keep: int | None = 2, format: str = "dcp"):
        every = 1 if every is None else every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every is a positive number of steps, got {every!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep is None (keep all) or at least 1, got {keep!r}")
        if not any(resume is r or (isinstance(r, str) and resume == r) for r in RESUME):
            raise ValueError(f"resume is False, True or \"weights_only\", got {resume!r}")
        if format not in FORMATS:
            raise ValueError(f"checkpoint_format is \"dcp\" (PyTorch's distributed checkpoint) "
                             f"or \"piper_nb\" (one .pt file), got {format!r}")
        optimizer = check_optimizer(optimizer, "pn.train")   # an OptimizerSpec stays itself
        self.plan, self.optimizer, self.dir = plan, optimizer, Path(directory)
        self.every, self.resume, self.keep, self.format = every, resume, keep, format
        self.fingerprint = plan_fingerprint(plan)
        self.written_by = fingerprint(plan, optimizer)
        self.written: list[Path] = []

    @classmethod
    def for_train(cls, plan, optimizer, directory, every, resume,
                  format: str = "dcp") -> Checkpointer | None:
        """None when `train` was given no directory (and then asks for no checkpoints)."""
        if directory is None:
            if resume or every is not None:
                raise ValueError("resume and checkpoint_every need checkpoint_dir=")
            return None
        return cls(plan, optimizer, directory, every, resume, format=format)

    def restore(self, cluster, steps: int | None = None
                ) -> tuple[int, list[float], list[float], list[StepMetrics]]:
        """Load the newest checkpoint into the workers when resuming: (step, losses, times,
        metrics). Without one (or without `resume`), (0, [], [], []): the run starts from
        the beginning. A checkpoint written by another model, plan, optimizer or scheduler
        is refused, naming what differs; with `resume="weights_only"` its parameters and
        buffers are loaded anyway (a warning names the differences) and the optimizer and
        scheduler start fresh, at the checkpoint's step."""
        path = latest(self.dir) if self.resume else None
        if path is None:
            return 0, [], [], []
        if path.is_dir():
            return self._restore_dcp(cluster, path, steps)
        if self.format == "dcp":
            warnings.warn(f"{path} is in piper_nb's own checkpoint format, which still resumes "
                          "this run; the checkpoints it writes now are PyTorch's DCP "
                          "(checkpoint_format=\"dcp\"), which plain PyTorch and torchtitan "
                          "load", stacklevel=4)
        obj = load(path)
        step = obj["step"]
        _step_of(path, steps, step)
        changed = self._changed(path, obj)
        weights_only = self.resume == "weights_only"
        if changed and not weights_only:
            raise PlanError(f"{path} was written by another run: {'; '.join(changed)}. Revert "
                            "the change to resume, give a fresh checkpoint_dir to start over, or "
                            "pass resume=\"weights_only\" to load only the model's weights (the "
                            f"optimizer and scheduler start fresh, at step {step})")
        states = list(obj["workers"])
        if weights_only:
            states = self._weights(path, obj, changed)
        n = getattr(cluster, "n", self.plan.world)
        empty = {"step": step, "full": {}, "shards": {}, "optim": {}}
        states += [empty] * (n - len(states))   # ranks beyond the plan's world hold nothing
        _require(cluster, "load_train_state")(self.plan, states)
        return step, list(obj["losses"]), list(obj["step_times"]), self.metrics(obj)

    def _restore_dcp(self, cluster, path: Path, steps: int | None):
        """Resume from a DCP checkpoint, onto this plan whatever plan wrote it: whole
        tensors read back, cut as this plan's devices hold them. The model, optimizer and
        scheduler must be the run's (the plan may differ)."""
        state, side = dcp.read(path)
        step = int(state["train_state.step"])
        _step_of(path, steps, step)
        missing = [n for n in dcp.Geometry(self.plan).shapes if n not in state]
        if missing:
            raise PlanError(f"{path} has no {', '.join(missing[:3])}: it holds another "
                            "model's weights; resume from a checkpoint of this model, or give "
                            "a fresh checkpoint_dir")
        changed = [c for c in differences(side.get("written_by", {}), self.written_by)
                   if c.startswith(("the optimizer", "the scheduler"))] if side else []
        changed = model_changes(side.get("written_by", {}), self.written_by,
                                side.get("model", {}), whole_model(self.plan)) + changed
        weights_only = self.resume == "weights_only"
        if changed and not weights_only:
            raise PlanError(f"{path} was written by another run: {'; '.join(changed)}. Revert "
                            "the change to resume, give a fresh checkpoint_dir, or pass "
                            "resume=\"weights_only\" to load only the model's weights")
        if changed:
            warnings.warn(f"resume=\"weights_only\": loading the weights of {path} although "
                          f"{'; '.join(changed)}; the optimizer and scheduler start fresh",
                          stacklevel=4)
        skeleton = _require(cluster, "train_state")(self.plan)
        if weights_only:   # no optimizer state; the groups and scheduler as built fresh
            state = {k: v for k, v in state.items() if not k.startswith(("optimizer.",
                                                                          "lr_scheduler"))}
        states = dcp.device_states(self.plan, self.optimizer, skeleton, state)
        _require(cluster, "load_train_state")(self.plan, states)
        metrics = [StepMetrics(**m) for m in side.get("metrics", [])]
        return step, list(side.get("losses", [])), list(side.get("step_times", [])), metrics

    def _sidecar(self, step, losses, times, metrics) -> dict:
        return {"format": DCP_FORMAT, "step": step, "data_position": step,
                "world": self.plan.world, "fingerprint": self.fingerprint,
                "written_by": self.written_by, "model": whole_model(self.plan),
                "losses": [float(x) for x in losses], "step_times": [float(x) for x in times],
                "metrics": [dataclasses.asdict(m) for m in metrics], "torch": str(torch.__version__)}

    def _changed(self, path: Path, obj: dict) -> list[str]:
        """What differs between the run that wrote `obj` and this one (a checkpoint from
        before fingerprints: whether the plan differs)."""
        if "written_by" in obj:
            return differences(obj["written_by"], self.written_by)
        if obj["fingerprint"] != self.fingerprint:
            return [f"the plan differs (world {obj['world']} -> {self.plan.world}, or its "
                    "program)"]
        return []

    def _weights(self, path: Path, obj: dict, changed: list[str]) -> list[dict]:
        """The checkpoint's parameters and buffers without optimizer state, after warning
        what differs; they load only into the parameter layout that wrote them."""
        old = obj.get("written_by", {}).get("plan", {}).get("parameter layout")
        if old is not None and old != self.written_by["plan"]["parameter layout"]:
            raise PlanError(f"{path}: resume=\"weights_only\" loads parameters as the plan "
                            "that wrote them laid them out, and this plan lays them out "
                            "differently (other shapes, world, ZeRO-3 buckets or tensor-parallel "
                            "shards); resume with that layout, or give a fresh checkpoint_dir")
        if changed:
            warnings.warn(f"resume=\"weights_only\": loading the weights of {path} although "
                          f"{'; '.join(changed)}; the optimizer and scheduler start fresh",
                          stacklevel=4)
        return [{"step": st["step"], "full": st["full"], "shards": st["shards"], "optim": {},
                 "buffers": st.get("buffers", {})} for st in obj["workers"]]

    @staticmethod
    def metrics(path_or_obj) -> list[StepMetrics]:
        """The `StepMetrics` of the steps a checkpoint covers (an older checkpoint, which
        kept losses and times only: made from those)."""
        obj = load(path_or_obj) if isinstance(path_or_obj, (str, os.PathLike)) else path_or_obj
        if "metrics" in obj:
            return [StepMetrics(**m) for m in obj["metrics"]]
        return [StepMetrics(i + 1, loss, t, math.nan)
                for i, (loss, t) in enumerate(zip(obj["losses"], obj["step_times"], strict=True))]

    def after_step(self, cluster, step: int, steps: int, losses: list[float],
                   times: list[float], metrics: list[StepMetrics] = ()) -> Path | None:
        """Write a checkpoint after `step` when it is due (every `every` steps and the last)."""
        if step % self.every and step != steps:
            return None
        states = _require(cluster, "train_state")(self.plan)[:self.plan.world]
        if not getattr(cluster, "writes_checkpoints", True):   # a job's other ranks
            return None
        if self.format == "dcp":
            path = save_dcp(self.dir, self.plan, self.optimizer, states,
                            self._sidecar(step, losses, times, metrics), self.keep)
            self.written.append(path)
            return path
        obj = {"format": FORMAT, "step": step, "data_position": step, "world": self.plan.world,
               "fingerprint": self.fingerprint, "written_by": self.written_by,
               "losses": [float(x) for x in losses], "step_times": [float(x) for x in times],
               "metrics": [dataclasses.asdict(m) for m in metrics], "workers": states,
               "torch": str(torch.__version__)}
        path = save(self.dir, obj, self.keep)
        self.written.append(path)
        return path


def _require(cluster, method: str):
    fn = getattr(cluster, method, None)
    if fn is None:
        raise PlanError(f"{type(cluster).__name__} cannot checkpoint: it has no {method}(); use "
                        "pn.LocalCluster or pn.IPyParallelCluster, or train without checkpoint_dir")
    return fn


def _step_of(path: Path, steps: int | None, step: int) -> None:
    if steps is not None and steps < step:
        raise PlanError(f"{path} is at step {step}, beyond steps={steps}: steps counts from "
                        f"the run's start, so pass steps greater than {step} to train on "
                        "from it, or give a fresh checkpoint_dir to start over")
