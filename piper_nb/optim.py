"""Optimizers as small frozen configs with a functional, element-wise `step`.

`pn.optim.SGD` and `pn.optim.AdamW` do exactly the arithmetic of `torch.optim.SGD` and
`torch.optim.AdamW` (their single-tensor, `foreach=False` path), but as a pure function of
one tensor: `opt.step(param, grad, state, step)` updates `param` in place and keeps its
buffers in the `state` dict. Every operation is element-wise, so updating a flat shard of
a bucket (ZeRO 1-3) gives bit-for-bit the same numbers as updating the full parameters;
the runtime and `pn.reference_train` both use these, so their results agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Optimizer", "SGD", "AdamW", "check_optimizer"]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class Optimizer:
    """Base class: `step` updates `param` from `grad` in place; `state` is its own dict."""

    lr: float                       # learning rate, > 0

    def __post_init__(self):
        _check(isinstance(self.lr, (int, float)) and self.lr > 0,
               f"{type(self).__name__}: lr must be a positive number, got {self.lr!r}")

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, step: int) -> None:
        raise NotImplementedError

    def state_bytes(self, state: dict) -> int:
        """Bytes held by the tensors of one parameter's `state`."""
        return sum(t.numel() * t.element_size() for t in state.values()
                   if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD (dampening 0, no Nesterov): momentum buffer `momentum_buffer`."""

    momentum: float = 0.0           # 0 disables the buffer
    weight_decay: float = 0.0       # L2 penalty added to the gradient

    def __post_init__(self):
        super().__post_init__()
        _check(0.0 <= self.momentum < 1.0, f"SGD: momentum must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0.0, f"SGD: weight_decay must be >= 0, got {self.weight_decay}")

    @torch.no_grad()
    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, step: int) -> None:
        d_p = grad
        if self.weight_decay != 0:
            d_p = d_p.add(param, alpha=self.weight_decay)
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.clone(d_p).detach()
                state["momentum_buffer"] = buf
            else:
                buf.mul_(self.momentum).add_(d_p, alpha=1.0)
            d_p = buf
        param.add_(d_p, alpha=-self.lr)


@dataclass(frozen=True)
class AdamW(Optimizer):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad): `exp_avg`, `exp_avg_sq`."""

    betas: tuple[float, float] = (0.9, 0.999)   # running-average coefficients, each in [0, 1)
    eps: float = 1e-8                           # added to the denominator
    weight_decay: float = 0.01                  # decoupled: param *= 1 - lr * weight_decay

    def __post_init__(self):
        super().__post_init__()
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
               f"AdamW: betas must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps > 0, f"AdamW: eps must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, f"AdamW: weight_decay must be >= 0, got {self.weight_decay}")

    @torch.no_grad()
    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, step: int) -> None:
        beta1, beta2 = self.betas
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        param.mul_(1 - self.lr * self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = self.lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def check_optimizer(optimizer: object, where: str = "train") -> Optimizer:
    """`optimizer` if it is a `pn.optim` optimizer, else a PlanError saying what to pass:
    raised before any worker starts, not at the first update."""
    from piper_nb.errors import PlanError
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        raise PlanError(f"{where}: optimizer={optimizer.__name__} is the class; pass an instance "
                        f"such as pn.optim.{optimizer.__name__}(lr=1e-3)")
    name = type(optimizer).__name__
    module = type(optimizer).__module__
    if module.startswith("torch.optim"):
        twin = {"SGD": "SGD(lr=..., momentum=..., weight_decay=...)",
                "AdamW": "AdamW(lr=..., betas=..., eps=..., weight_decay=...)",
                "Adam": "AdamW(lr=..., weight_decay=0.0)"}.get(name)
        hint = (f"use pn.optim.{twin}, the same arithmetic" if twin
                else "use pn.optim.SGD or pn.optim.AdamW")
        raise PlanError(f"{where}: optimizer is a torch.optim.{name}, which is bound to this "
                        f"process's parameters and cannot update the workers' shards; {hint}")
    raise PlanError(f"{where}: optimizer must be a pn.optim optimizer (pn.optim.SGD(lr=...) or "
                    f"pn.optim.AdamW(lr=...)), got {module}.{name}")
