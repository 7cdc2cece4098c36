"""The update of one device: its torch optimizer, learning-rate schedule and gradient clipping.

`Updater` builds the device's optimizer once from the `OptimizerSpec` (one parameter group
per spec group, the default last) and, at each U, binds to it the tensors this device
updates there: full parameters, and the pieces of its bucket shards (a shard cut where the
parameter group changes, `optim.shard_pieces`). Each tensor's state lives in the
`ParamStore`'s `state` dict under a stable key (the parameter's name, or
("bucket", b, first name) for a piece), so it survives steps, is counted as optimizer
memory, and goes into checkpoints; the optimizer itself keeps only its parameter groups
(learning rates the scheduler moves). The scheduler steps once per training step. A bf16
plan steps fp32 master copies (kept in the store's state as ("master", key)) and rounds
them back into the bf16 parameters (`compiler.precision`).

With clipping, `norm_share` is this device's weighted share of the squared global gradient
norm (see `compiler.clip`), `set_norm` takes the all-reduced sum, and U scales every
gradient by `min(1, max_norm / (norm + 1e-6))` first, as `clip_grad_norm_` does.
"""

from __future__ import annotations

import torch

from piper_nb.ir.kinds import Op
from piper_nb.optim import OptimizerSpec
from piper_nb.plan.clipping import norm_weights
from piper_nb.runtime.stores import ParamStore

__all__ = ["Updater"]


class Updater:
    def __init__(self, spec: OptimizerSpec, store: ParamStore, plan, instrs):
        self.spec, self.store = spec, store
        self.opt, self.sched = spec.build()
        self.opt.state.clear()     # some (Adagrad) make state for the placeholders
        for g in self.opt.param_groups:
            g["params"] = []
        self.max_norm = plan.clip_grad_norm
        self.mixed = plan.precision != "fp32"    # fp32 masters for low-precision parameters
        self.norm_tensor: torch.Tensor | None = None
        self.coef: torch.Tensor | None = None
        self.count_tensor: torch.Tensor | None = None   # loss_mean="global": the batch's count
        mine = {b for i in instrs if i.kind == Op.U for b in i.data.buckets}
        self.full = {n for i in instrs if i.kind == Op.U for n in i.data.params}
        self.pieces = {b: self._pieces(b, spec.group_of) for b in mine}
        self.params_of = {b: self._pieces(b, lambda n: n) for b in mine}   # one per parameter
        self.weights = norm_weights(plan) if self.max_norm is not None else {}

    def _pieces(self, b: int, group_of) -> list[tuple]:
        return self.store.layouts[b].pieces(self.store.device_id, group_of)

    # -- the update --
    def update(self, names: tuple[str, ...], buckets: tuple[int, ...]) -> None:
        """U: clip, bind, one optimizer step over everything this U updates, unbind."""
        full, shards = self.store.to_update(names, buckets)
        items = [(n, self.spec.group_of(n), p, p.grad) for n, p in full]
        for b, shard, grad in shards:
            for name, lo, hi, g in self.pieces[b]:
                items.append((("bucket", b, name), g, shard[lo:hi], grad[lo:hi]))
        if items and self.mixed:
            self._step_masters(items)
        elif items:
            self._step(items)
        self.store.grads_done(names)

    def _step_masters(self, items: list[tuple]) -> None:
        """bf16 plans: the optimizer steps fp32 masters (made from the bf16 parameters at the
        first update) on the gradients in fp32; the parameters get the masters rounded."""
        state, masters = self.store.state, []
        for key, g, t, grad in items:
            held = state.setdefault(("master", key), {})
            if "master" not in held:
                held["master"] = t.detach().float().clone()
            masters.append((key, g, held["master"], grad.float()))
        self._step(masters)
        with torch.no_grad():
            for (_, _, t, _), (_, _, m, _) in zip(items, masters, strict=True):
                t.copy_(m)

    def _step(self, items: list[tuple]) -> None:
        groups, state = self.opt.param_groups, self.store.state
        factor = self._factor()
        for key, g, t, grad in items:
            if factor is not None:
                grad.mul_(factor.to(grad.dtype))
            if t.grad is not grad:
                t.grad = grad
            groups[min(g, len(groups) - 1)]["params"].append(t)
            self.opt.state[t] = state.setdefault(key, {})
        try:
            self.opt.step()
        finally:
            for grp in groups:
                grp["params"] = []
            self.opt.state.clear()
            for _, _, t, _ in items:
                t.grad = None

    def end_step(self) -> None:
        """After the step: the schedule moves on; the norm is spent."""
        if self.sched is not None:
            self.sched.step()
        self.coef = None
        self.count_tensor = None

    def lr(self) -> float:
        """The default group's learning rate (the one this step used, before `end_step`)."""
        return float(self.opt.param_groups[-1]["lr"])

    def _factor(self) -> torch.Tensor | None:
        """What U multiplies the gradients by: 1 / the count (global loss), then the clip."""
        scale = None if self.count_tensor is None else 1.0 / self.count_tensor
        if self.coef is None:
            return scale
        return self.coef if scale is None else (scale * self.coef.double())

    # -- the global-batch loss --
    def set_count(self, total: torch.Tensor) -> None:
        """The all-reduced count of the whole batch (`compiler.global_loss`): U divides the
        gradients by it, and the norm is the norm of the divided gradients."""
        self.count_tensor = total.reshape(()).double()

    @property
    def count(self) -> float | None:
        """The step's count (read after the step: a host sync there)."""
        t = self.count_tensor
        return None if t is None else float(t)

    # -- clipping --
    def norm_share(self) -> torch.Tensor:
        """This device's weighted share of the squared global gradient norm (float64), of
        the gradients divided by the count under the global-batch loss."""
        total = torch.zeros(1, dtype=torch.float64, device=self.store.device)
        w = self.weights
        for n in sorted(self.full):
            g = self.store.params[n].grad
            if g is not None:
                total += w[n] * g.detach().double().square().sum()
        for b in sorted(self.params_of):
            grad = self.store.grad_shards.get(b)
            if grad is None:
                continue
            for name, lo, hi, _ in self.params_of[b]:
                total += w[name] * grad[lo:hi].double().square().sum()
        if self.count_tensor is not None:
            total = total / self.count_tensor.square()
        return total

    def set_norm(self, total: torch.Tensor) -> None:
        """The all-reduced squared norm: the norm, and the scale U applies (fp32, as torch,
        which multiplies even by 1). Both stay tensors: nothing here stops the host; the norm
        is read once the step is over (`grad_norm`)."""
        norm = torch.sqrt(total.reshape(())).float()
        self.norm_tensor = norm
        self.coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)

    @property
    def norm(self) -> float | None:
        """The last step's global gradient norm (read after the step: a host sync there)."""
        t = self.norm_tensor
        return None if t is None else float(t)

    # -- checkpoints --
    def state_dict(self) -> dict:
        return {"groups": [{k: v for k, v in g.items() if k != "params"}
                           for g in self.opt.param_groups],
                "scheduler": None if self.sched is None else self.sched.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        for g, saved in zip(self.opt.param_groups, st["groups"], strict=True):
            g.update(saved)
        if self.sched is not None and st.get("scheduler") is not None:
            self.sched.load_state_dict(st["scheduler"])
