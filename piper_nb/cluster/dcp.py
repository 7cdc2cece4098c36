"""Checkpoints in PyTorch's distributed format (`torch.distributed.checkpoint`, DCP).

A checkpoint is a directory `step-000012/` that `dcp.load` reads in any process: a plain
single-process model, torchtitan, or another piper_nb plan. Its keys are torchtitan's:

- the model's parameters and buffers at the top level, under `model.state_dict()`'s names
  (each name of a tied weight);
- `optimizer.state.<name>.<key>` and `optimizer.param_groups.<name>.<key>`: the optimizer
  state by parameter name, as `get_optimizer_state_dict(...,
  StateDictOptions(flatten_optimizer_state_dict=True))` lays it out; a bf16 plan's fp32
  master weights are `optimizer.state.<name>.master`;
- `lr_scheduler` (its `state_dict()`) and `train_state.step`.

Each tensor is stored as the plan holds it: one chunk per tensor-parallel shard, expert
piece and ZeRO shard (a flat ZeRO range cut into boxes, `dcp_layout.boxes`), written once
however many replicas hold it, into one file per device (`__<device>_0.distcp`). The driver
writes them, as it holds every device's state at a checkpoint; `piper_nb.json` beside them
keeps what only piper_nb reads (losses, metrics, fingerprints).

`device_states` goes the other way: whole tensors read back with `dcp.load`, cut into what
each device of any plan holds, so a run resumes on another layout (PP 4 from PP 2).
"""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from piper_nb.cluster.dcp_layout import Geometry, boxes
from piper_nb.runtime.layout import bucket_layouts

__all__ = ["SIDECAR", "write", "read", "device_states", "is_dcp"]

SIDECAR = "piper_nb.json"
OPT, GROUPS = "optimizer.state.", "optimizer.param_groups."


def is_dcp(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").exists()


class _Items:
    """The chunks to write, per device, each (name, offsets) once."""

    def __init__(self, world: int):
        self.plans: list[list[WriteItem]] = [[] for _ in range(world)]
        self.data: dict[MetadataIndex, object] = {}

    def tensor(self, device: int, key: str, offsets, chunk: torch.Tensor, whole) -> None:
        index = MetadataIndex(key, torch.Size(offsets))
        if index in self.data:
            return
        chunk = chunk.detach().contiguous()
        self.data[index] = chunk
        self.plans[device].append(WriteItem(
            index=index, type=WriteItemType.SHARD if tuple(whole) != tuple(chunk.shape)
            else WriteItemType.TENSOR,
            tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), chunk.shape),
                                        TensorProperties.create_from_tensor(chunk),
                                        torch.Size(whole))))

    def value(self, device: int, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            return self.tensor(device, key, (0,) * value.dim(), value, value.shape)
        index = MetadataIndex(key)
        if index in self.data:
            return
        buf = io.BytesIO()
        torch.save(value, buf)
        self.data[index] = buf
        self.plans[device].append(WriteItem(index=index, type=WriteItemType.BYTE_IO))


class _Planner(SavePlanner):
    """Hands DCP's writer the chunks `_Items` made (one process writes every device's)."""

    def __init__(self, data):
        self.data = data

    def set_up_planner(self, *args, **kwargs) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, plans):
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        found = self.data[write_item.index]
        if isinstance(found, io.BytesIO):
            found.seek(0)
        return found


class _Writer:
    """One device's state into `_Items`, under the model's names."""

    def __init__(self, plan, spec, items: _Items):
        self.plan, self.spec, self.items = plan, spec, items
        self.geo, self.layouts = Geometry(plan), bucket_layouts(plan)
        self.aliases = _aliases(plan)

    def whole(self, device: int, prefix: str, name: str, t: torch.Tensor, key: str = "") -> None:
        """A device tensor `name` (or its optimizer state `key`) held whole on `device`."""
        self.box(device, prefix, name, ((0,) * t.dim(), tuple(t.shape)), t, key)

    def box(self, device, prefix, name, box, chunk, key="") -> None:
        fqn = self.geo.fqn(name)
        shape = self.geo.shapes.get(fqn, tuple(chunk.shape))
        for (offsets, _), rel in self.geo.to_global(name, self.geo.tp_rank(device), box):
            for alias in self.aliases.get(fqn, (fqn,)) if not prefix else (fqn,):
                self.items.tensor(device, f"{prefix}{alias}{key}", offsets, chunk[rel], shape)

    def flat(self, device, prefix, bucket: int, start: int, values: torch.Tensor, key="") -> None:
        """`values`: the bucket's flat elements from `start` on (a ZeRO shard or piece)."""
        lay = self.layouts[bucket]
        end = start + values.numel()
        for name, off, shape in zip(lay.names, lay.offsets, lay.shapes, strict=True):
            lo, hi = max(off, start), min(off + math.prod(shape), end)
            for box, a, b in boxes(shape, lo - off, hi - off):
                chunk = values[off + a - start:off + b - start].reshape(box[1])
                self.box(device, prefix, name, box, chunk, key)

    def device(self, d: int, st: dict) -> None:
        for name, t in st.get("full", {}).items():
            self.whole(d, "", name, t)
        for b, (pos, t) in st.get("shards", {}).items():
            self.flat(d, "", b, pos * self.layouts[b].shard, t)
        for name, t in st.get("buffers", {}).items():
            self.items.tensor(d, name, (0,) * t.dim(), t, t.shape)
        for key, state in st.get("optim", {}).items():
            master = isinstance(key, tuple) and key[0] == "master"
            inner = key[1] if master else key
            for k, v in state.items():
                self.state(d, inner, "master" if master else k, v)

    def state(self, d: int, key, k: str, v) -> None:
        if isinstance(key, str):
            shaped = isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(
                self.plan.params[key][0])
            if shaped:
                return self.whole(d, OPT, key, v, f".{k}")
            return self.items.value(d, f"{OPT}{self.geo.fqn(key)}.{k}", v)
        _, b, first = key
        lay = self.layouts[b]
        pos = lay.position(d)
        lo, hi = lay.piece(d, self.spec.group_of, first)
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == hi - lo:
            return self.flat(d, OPT, b, pos * lay.shard + lo, v, f".{k}")
        start, stop = pos * lay.shard + lo, pos * lay.shard + hi
        for name, off, shape in zip(lay.names, lay.offsets, lay.shapes, strict=True):
            if off < stop and off + math.prod(shape) > start:      # a scalar per parameter
                self.items.value(d, f"{OPT}{self.geo.fqn(name)}.{k}", v)


def _aliases(plan) -> dict[str, tuple[str, ...]]:
    """Each parameter's names in `model.state_dict()` (a tied weight has several)."""
    model = getattr(getattr(plan, "capture", None), "model", None)
    if model is None:
        return {}
    by_tensor: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
    return {names[0]: tuple(names) for names in by_tensor.values() if len(names) > 1}


def write(directory: Path, plan, spec, states: list[dict], step: int, sidecar: dict) -> None:
    """Every device's `train_state()` (`states`) as a DCP checkpoint in `directory` (new)."""
    items = _Items(plan.world)
    writer = _Writer(plan, spec, items)
    for d, st in enumerate(states[:plan.world]):
        writer.device(d, st)
    update = next((st["update"] for st in states if st.get("update")), None)
    if update is not None:
        _groups(writer, update)
    items.value(0, "train_state.step", torch.tensor(step, dtype=torch.int64))
    storage = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                               thread_count=1, overwrite=False)
    storage.set_up_storage_writer(True)
    local = [storage.prepare_local_plan(SavePlan(p)) for p in items.plans]
    plans, metadata = create_default_global_save_plan(local)
    planner, results = _Planner(items.data), []
    for p in storage.prepare_global_plan(plans):
        done = storage.write_data(p, planner)
        done.wait()
        results.append(done.value())
    (directory / SIDECAR).write_text(json.dumps(sidecar))
    storage.finish(metadata, results)        # .metadata last: a checkpoint is whole or absent


def _groups(writer: _Writer, update: dict) -> None:
    """Each parameter's group hyperparameters (`optimizer.param_groups.<name>.<key>`) and
    the scheduler's state."""
    groups, spec, items = update["groups"], writer.spec, writer.items
    names = {writer.geo.fqn(n): n for n in writer.plan.params}
    for fqn, name in names.items():
        for k, v in groups[spec.group_of(name)].items():
            items.value(0, f"{GROUPS}{fqn}.{k}", v)
    if update.get("scheduler") is not None:
        items.value(0, "lr_scheduler", update["scheduler"])


def read(path: Path) -> tuple[dict[str, object], dict]:
    """Every entry of the checkpoint at `path`, whole (key -> tensor or value), and its
    sidecar (empty for a checkpoint piper_nb did not write)."""
    meta = FileSystemReader(path).read_metadata()
    state: dict[str, object] = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[key] = None
    with warnings.catch_warnings():     # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    side = path / SIDECAR
    return state, (json.loads(side.read_text()) if side.exists() else {})


def device_states(plan, spec, skeleton: list[dict], state: dict) -> list[dict]:
    """What each device of `plan` holds, cut from the checkpoint's whole tensors: the
    `train_state()` form `load_train_state` takes (`skeleton`: the devices' own states
    after reset, which name what each holds)."""
    geo, layouts = Geometry(plan), bucket_layouts(plan)
    step = int(state["train_state.step"])

    def local(name: str, d: int, prefix: str = "", key: str = "") -> torch.Tensor:
        return geo.local(name, geo.tp_rank(d), state[f"{prefix}{geo.fqn(name)}{key}"])

    flats: dict[tuple, torch.Tensor] = {}

    def flat(b: int, d: int, prefix: str = "", key: str = "") -> torch.Tensor:
        """Bucket b as device d's tensor-parallel rank lays it out flat (made once per
        rank, not per replica and piece)."""
        lay = layouts[b]
        at = (b, geo.tp_rank(d), prefix, key)
        if at not in flats:
            flats[at] = lay.flatten([local(n, d, prefix, key) for n in lay.names],
                                    like=state[f"{prefix}{geo.fqn(lay.names[0])}{key}"])
        return flats[at]

    out = []
    for d, sk in enumerate(skeleton):
        if d >= plan.world:
            out.append({"step": step, "full": {}, "shards": {}, "optim": {}})
            continue
        st = {"step": step, "full": {n: local(n, d).clone() for n in sk.get("full", {})},
              "shards": {b: (pos, flat(b, d)[pos * layouts[b].shard:(pos + 1)
                                              * layouts[b].shard].clone())
                         for b, (pos, _) in sk.get("shards", {}).items()},
              "buffers": {n: state[n].clone() for n in sk.get("buffers", {})},
              "optim": _optim(plan, spec, d, state, geo, layouts, local, flat)}
        if sk.get("update") is not None:
            st["update"] = _update(plan, spec, sk["update"], state, geo)
        out.append(st)
    return out


def _optim(plan, spec, d, state, geo, layouts, local, flat) -> dict:
    """Device d's optimizer state: whole parameters it updates by name, its ZeRO pieces by
    ("bucket", b, first name), fp32 masters under ("master", that key)."""
    from piper_nb.ir.kinds import Op
    names, buckets = set(), set()
    for ins in plan.devices[d].instrs:
        if ins.kind == Op.U:
            names.update(ins.data.params)
            buckets.update(ins.data.buckets)
    out: dict = {}

    def keys(name):
        head = f"{OPT}{geo.fqn(name)}."
        return [k[len(head):] for k in state if k.startswith(head)
                and "." not in k[len(head):]]

    for name in sorted(names):
        st = {}
        for k in keys(name):
            v = state[f"{OPT}{geo.fqn(name)}.{k}"]
            st[k] = (local(name, d, OPT, f".{k}").clone()
                     if isinstance(v, torch.Tensor) and v.dim() > 0 else _copy(v))
        _split_master(out, name, st)
    for b in sorted(buckets):
        lay = layouts[b]
        pos = lay.position(d)
        for first, lo, hi, _ in lay.pieces(d, spec.group_of):
            st = {}
            for k in keys(first):
                v = state[f"{OPT}{geo.fqn(first)}.{k}"]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    st[k] = flat(b, d, OPT, f".{k}")[pos * lay.shard + lo:
                                                     pos * lay.shard + hi].clone()
                else:
                    st[k] = _copy(v)
            _split_master(out, ("bucket", b, first), st)
    return out


def _split_master(out: dict, key, st: dict) -> None:
    master = st.pop("master", None)
    if st:
        out[key] = st
    if master is not None:
        out[("master", key)] = {"master": master}


def _copy(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


def _update(plan, spec, fresh: dict, state: dict, geo) -> dict:
    """The optimizer's groups as the checkpoint left them, and the scheduler's state."""
    groups = [dict(g) for g in fresh["groups"]]
    for name in plan.params:
        g = groups[spec.group_of(name)]
        for k in g:
            g[k] = state.get(f"{GROUPS}{geo.fqn(name)}.{k}", g[k])
    return {"groups": groups, "scheduler": state.get("lr_scheduler", fresh.get("scheduler"))}
