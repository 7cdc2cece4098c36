"""Checkpoints of a training run: written atomically, loaded without unpickling code.

`pn.train(..., checkpoint_dir=d, checkpoint_every=K)` writes `d/step-000012.pt` every K
steps and after the last one; `resume=True` continues from the newest file in `d`. A
checkpoint holds the whole training state at a step boundary: every rank's parameters
(full, or its ZeRO-3 shards) and optimizer state with the step count (what the workers'
`train_state` reports), the number of batches consumed (a loader is advanced past them on
resume), the losses and step times so far, the optimizer's settings and a fingerprint of
the plan, so a resumed run ends bit for bit where an uninterrupted one would.

A file is written to a temporary name in the same directory, flushed, fsynced and then
renamed over its final name (`os.replace`, atomic on POSIX and Windows), and the directory
is fsynced: a crash mid-write leaves the previous checkpoint intact and no torn file under
a checkpoint's name. Files are read with `torch.load(weights_only=True)`: tensors, numbers,
strings and containers only, so a checkpoint from elsewhere cannot run code. The newest
`keep` checkpoints are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from pathlib import Path

import torch

from piper_nb.errors import PlanError, RuntimeFailure
from piper_nb.metrics import StepMetrics

__all__ = ["FORMAT", "Checkpointer", "save", "load", "latest", "checkpoints", "plan_fingerprint",
           "full_state"]

FORMAT = "piper_nb.checkpoint/1"
_NAME = re.compile(r"^step-(\d{6,})\.pt$")


def plan_fingerprint(plan) -> str:
    """sha256 of what decides where state lives: the plan's JSON without measured sizes."""
    obj = json.loads(plan.to_json())
    obj.pop("saved", None)
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _optimizer_record(optimizer) -> dict:
    if hasattr(optimizer, "record"):   # an OptimizerSpec: factory, groups and scheduler
        return optimizer.record()
    fields = dataclasses.asdict(optimizer) if dataclasses.is_dataclass(optimizer) else {}
    return {"type": type(optimizer).__name__,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
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
    if keep is not None:
        for _, old in checkpoints(d)[:-keep]:
            old.unlink(missing_ok=True)
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
    """What `pn.train` calls: `restore(cluster)` after `reset`, `after_step(...)` per step."""

    def __init__(self, plan, optimizer, directory: str | os.PathLike, every: int | None = None,
                 resume: bool = False, keep: int | None = 2):
        every = 1 if every is None else every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every is a positive number of steps, got {every!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep is None (keep all) or at least 1, got {keep!r}")
        self.plan, self.optimizer, self.dir = plan, optimizer, Path(directory)
        self.every, self.resume, self.keep = every, resume, keep
        self.fingerprint = plan_fingerprint(plan)
        self.written: list[Path] = []

    @classmethod
    def for_train(cls, plan, optimizer, directory, every, resume) -> Checkpointer | None:
        """None when `train` was given no directory (and then asks for no checkpoints)."""
        if directory is None:
            if resume or every is not None:
                raise ValueError("resume and checkpoint_every need checkpoint_dir=")
            return None
        return cls(plan, optimizer, directory, every, resume)

    def restore(self, cluster) -> tuple[int, list[float], list[float], list[StepMetrics]]:
        """Load the newest checkpoint into the workers when resuming: (step, losses, times,
        metrics). Without one (or without `resume`), (0, [], [], []): the run starts from
        the beginning."""
        path = latest(self.dir) if self.resume else None
        if path is None:
            return 0, [], [], []
        obj = load(path)
        if obj["fingerprint"] != self.fingerprint:
            raise PlanError(f"{path} was written by a different plan (world {obj['world']}); resume "
                            "with the plan that wrote it, or give a fresh checkpoint_dir")
        want = _optimizer_record(self.optimizer)
        if obj["optimizer"] != want:
            raise PlanError(f"{path} was written with optimizer {obj['optimizer']} but train got "
                            f"{want}; pass the same optimizer, or give a fresh checkpoint_dir")
        n = getattr(cluster, "n", self.plan.world)
        states = list(obj["workers"])
        empty = {"step": obj["step"], "full": {}, "shards": {}, "optim": {}}
        states += [empty] * (n - len(states))   # ranks beyond the plan's world hold nothing
        _require(cluster, "load_train_state")(self.plan, states)
        return obj["step"], list(obj["losses"]), list(obj["step_times"]), self.metrics(obj)

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
        obj = {"format": FORMAT, "step": step, "data_position": step, "world": self.plan.world,
               "fingerprint": self.fingerprint, "optimizer": _optimizer_record(self.optimizer),
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
