"""A compiled plan as a directory a batch job runs: `plan.save(path)`, `pn.load_plan(path)`.

The directory holds three files:

- `manifest.json`: the format's version, the piper_nb, torch and Python versions that
  wrote it, the plan's device count and summary, and each other file's size and SHA-256;
- `plan.pkl`: the plan with its captured model and regions, and the training settings
  (the optimizer factory, parameter groups, scheduler, clipping, seed), pickled with
  cloudpickle (a notebook's classes and functions go by value) and every tensor taken out;
- `weights.pt`: those tensors (parameters, buffers, the example batch), `torch.save`d and
  loaded with `weights_only=True`.

**Trust.** `plan.pkl` is code: the regions piper_nb generated from your model, your
model's classes and your optimizer factory, as `torch.save(model)` would hold them.
Loading it runs that code, so load only plan directories you (or someone you trust)
wrote. The tensors never pass through an unpickler that can run code. The manifest's
hashes find a truncated or corrupted file (a copy cut short); they do not sign it.

A directory from another format, piper_nb version, or torch minor version is refused,
naming both versions: the pickled classes are piper_nb's and torch's own and change
between versions. Saving over a plan directory replaces it whole (written aside, then
renamed); saving into any other non-empty directory is refused.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import torch
from torch import nn

from piper_nb.errors import PlanError

__all__ = ["SavedPlan", "save_plan", "load_plan", "FORMAT"]

FORMAT = 1
MANIFEST, CODE, WEIGHTS = "manifest.json", "plan.pkl", "weights.pt"


def _version() -> str:
    try:
        return importlib.metadata.version("piper_nb")
    except importlib.metadata.PackageNotFoundError:   # a source tree on sys.path
        return "0+unknown"


@dataclass
class SavedPlan:
    """A plan read back from its directory, with what training it needs: `optimizer`
    (the factory `pn.train` takes), `settings` (`param_groups`, `lr_scheduler`,
    `clip_grad_norm`, `seed`: `pn.train`'s keywords) and `batch`, the batch saved with it
    (None if none was): `pn.train(s.plan, s.batch, steps, s.optimizer, **s.settings)`."""

    plan: object
    optimizer: Callable | None
    settings: dict
    batch: object
    path: Path
    manifest: dict


def save_plan(plan, path: str | os.PathLike, optimizer: Callable | None = None, *,
              batch=None, param_groups: list[dict] | None = None,
              lr_scheduler: Callable | None = None, clip_grad_norm: float | None = None,
              seed: int | None = None) -> Path:
    """Write `plan` (compiled, with its captured model) and its training settings as the
    directory `path`; returns it. See the module docstring for the files and the trust."""
    if plan.capture is None:
        raise PlanError("plan.save: this plan carries no captured model (it was read from "
                        "JSON?); compile it with pn.compile(spec, program, batch) to save it")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise PlanError(f"plan.save: seed must be an integer, got {seed!r}")
    path = Path(path)
    _check_target(path)
    settings = {"param_groups": param_groups, "lr_scheduler": lr_scheduler,
                "clip_grad_norm": clip_grad_norm, "seed": seed}
    tensors: dict[str, torch.Tensor] = {}
    buf = io.BytesIO()
    try:
        _Pickler(buf, tensors).dump({"plan": plan, "optimizer": optimizer,
                                     "settings": settings, "batch": batch})
    except Exception as err:   # noqa: BLE001 - what cannot be pickled, said plainly
        raise PlanError(f"plan.save: the plan or its settings cannot be pickled "
                        f"({type(err).__name__}: {err}); a lambda or a local function is "
                        "fine, an open file or a lock is not") from None
    parent = path.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=parent))
    try:
        (tmp / CODE).write_bytes(buf.getvalue())
        torch.save(tensors, tmp / WEIGHTS)
        manifest = {"format": FORMAT, "piper_nb": _version(), "torch": torch.__version__,
                    "python": platform.python_version(), "devices": plan.world,
                    "summary": repr(plan), "files": {
                        name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                        for name in (CODE, WEIGHTS)}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_plan(path: str | os.PathLike) -> SavedPlan:
    """The plan directory `path` read back (`SavedPlan`): its manifest checked (format,
    versions, every file's size and hash) before anything is unpickled."""
    path = Path(path)
    manifest = _manifest(path)
    tensors = _weights(path)
    try:
        saved = _Unpickler(io.BytesIO((path / CODE).read_bytes()), tensors).load()
    except (ImportError, AttributeError) as err:
        raise PlanError(f"{path / CODE}: the plan refers to code this process cannot import "
                        f"({err}); install the model's package here, as on the machine that "
                        "saved it") from None
    return SavedPlan(saved["plan"], saved["optimizer"], saved["settings"], saved["batch"],
                     path, manifest)


def _check_target(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise PlanError(f"plan.save: {path} is a file; give a directory path")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).exists():
        raise PlanError(f"plan.save: {path} is a non-empty directory that holds no plan "
                        f"({MANIFEST}); give a new or empty directory, so nothing there is "
                        "overwritten")


def _replace(tmp: Path, path: Path) -> None:
    """`tmp` renamed to `path`; an old plan directory there moved aside first, removed after."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _manifest(path: Path) -> dict:
    if not path.is_dir():
        raise PlanError(f"pn.load_plan: {path} is not a directory; give the directory "
                        "plan.save wrote")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise PlanError(f"pn.load_plan: {path} holds no {MANIFEST}: not a plan directory "
                        "(plan.save writes one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanError(f"pn.load_plan: {path / MANIFEST} is corrupted ({err}); save the "
                        "plan again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise PlanError(f"pn.load_plan: {path} is plan format {got!r}, and this piper_nb "
                        f"({_version()}) reads format {FORMAT}; save the plan again with "
                        "this version")
    if manifest.get("piper_nb") != _version():
        raise PlanError(f"pn.load_plan: {path} was saved by piper_nb {manifest.get('piper_nb')}"
                        f" and this is piper_nb {_version()}; install the same version on "
                        "every machine of the job, or save the plan again with this one")
    if _minor(manifest.get("torch")) != _minor(torch.__version__):
        raise PlanError(f"pn.load_plan: {path} was saved with torch {manifest.get('torch')} "
                        f"and this is torch {torch.__version__}; the pickled regions need "
                        "the same torch minor version: install it, or save the plan again")
    for name in (CODE, WEIGHTS):
        _check_file(path / name, manifest.get("files", {}).get(name))
    return manifest


def _minor(version) -> tuple:
    return tuple(str(version).split("+")[0].split(".")[:2])


def _check_file(file: Path, want: dict | None) -> None:
    if not file.exists():
        raise PlanError(f"pn.load_plan: {file} is missing; copy the whole plan directory")
    if not isinstance(want, dict):
        raise PlanError(f"pn.load_plan: the manifest lists no {file.name}; save the plan again")
    size = file.stat().st_size
    if size != want.get("bytes") or _sha256(file) != want.get("sha256"):
        what = (f"is {size} bytes, the manifest says {want.get('bytes')}"
                if size != want.get("bytes") else "does not match the manifest's SHA-256")
        raise PlanError(f"pn.load_plan: {file} {what}: truncated or corrupted (an unfinished "
                        "copy?); copy it again, or save the plan again")


def _weights(path: Path) -> dict:
    try:
        return torch.load(path / WEIGHTS, map_location="cpu", weights_only=True)
    except Exception as err:   # noqa: BLE001 - the hash matched: a tensor we cannot rebuild
        raise PlanError(f"pn.load_plan: {path / WEIGHTS} does not load as tensors only "
                        f"({type(err).__name__}: {err})") from None


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with every plain tensor and parameter kept out of the stream (into
    `tensors`, under a key the stream refers to), once per tensor: tied weights stay tied."""

    def __init__(self, file, tensors: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.keys = tensors, {}

    def persistent_id(self, obj):
        if type(obj) not in (torch.Tensor, nn.Parameter):
            return None
        key = self.keys.get(id(obj))
        if key is None:
            key = self.keys[id(obj)] = f"t{len(self.tensors)}"
            self.tensors[key] = obj
        return key


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: dict):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, key):
        return self.tensors[key]
