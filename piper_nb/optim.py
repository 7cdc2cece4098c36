"""Optimizers for `pn.train`: any `torch.optim` optimizer, built on every device over what
that device updates, with parameter groups named by pattern and a learning-rate schedule.

`pn.train(..., optimizer=functools.partial(torch.optim.AdamW, lr=3e-4), param_groups=[
{"params": ["*norm*", "*.bias"], "weight_decay": 0.0}], lr_scheduler=lambda opt: ...)`:
`optimizer` is a factory (a torch.optim class, a `functools.partial` of one, or any callable
taking parameter groups); `check_optimizer` bundles the three into one `OptimizerSpec`, checked
before any worker starts. Each device builds the optimizer once and, at every update, hands it
the tensors it updates there: full parameters, or the pieces of its ZeRO shard of a bucket (a
shard is cut where the parameter group changes, so each piece has one group's settings). That
is exact for an element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam,
RAdam, ...): every element's update depends on that element alone. One that is not
(Adafactor's factored statistics, Muon's orthogonalised matrices) needs whole parameters, so
it is refused under ZeRO (`requires_whole`).

`pn.optim.SGD` and `pn.optim.AdamW` stay as small frozen conveniences: factories with checked
settings that build `torch.optim.SGD` / `torch.optim.AdamW` (single-tensor path).
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from piper_nb.errors import PlanError

__all__ = ["SGD", "AdamW", "OptimizerSpec", "check_optimizer", "shard_pieces", "ELEMENTWISE"]

# torch.optim classes whose update of an element reads only that element's parameter,
# gradient and state: a flat shard updates exactly as the whole parameter would
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                         "RAdam", "ASGD", "Rprop", "Adadelta"})
# ... and those that need more than per-element information, with why
NOT_ELEMENTWISE = {
    "Adafactor": "keeps factored row and column statistics of each matrix",
    "Muon": "orthogonalises each weight matrix as a whole",
    "Shampoo": "keeps per-dimension preconditioner matrices",
    "SparseAdam": "needs sparse gradients",
}
REFUSED = {"LBFGS": "needs a closure that re-evaluates the whole model at every update, which "
                    "a pipelined step cannot offer",
           "SparseAdam": "needs sparse gradients, which the runtime never produces"}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class SGD:
    """`torch.optim.SGD(params, lr, momentum, weight_decay)`, single-tensor path."""

    lr: float
    momentum: float = 0.0           # 0 disables the buffer
    weight_decay: float = 0.0       # L2 penalty added to the gradient

    def __post_init__(self):
        _check(isinstance(self.lr, (int, float)) and self.lr > 0,
               f"SGD: lr must be a positive number, got {self.lr!r}")
        _check(0.0 <= self.momentum < 1.0, f"SGD: momentum must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0.0, f"SGD: weight_decay must be >= 0, got {self.weight_decay}")

    def __call__(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay, foreach=False)


@dataclass(frozen=True)
class AdamW:
    """`torch.optim.AdamW(params, lr, betas, eps, weight_decay)`, single-tensor path."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)   # running-average coefficients, each in [0, 1)
    eps: float = 1e-8                           # added to the denominator
    weight_decay: float = 0.01                  # decoupled: param *= 1 - lr * weight_decay

    def __post_init__(self):
        _check(isinstance(self.lr, (int, float)) and self.lr > 0,
               f"AdamW: lr must be a positive number, got {self.lr!r}")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
               f"AdamW: betas must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps > 0, f"AdamW: eps must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, f"AdamW: weight_decay must be >= 0, got {self.weight_decay}")

    def __call__(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=False)


def _describe(fn) -> str:
    """A stable text for a factory (checkpoints compare it): no memory addresses."""
    if isinstance(fn, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in sorted(fn.keywords.items()))
        args = ", ".join(repr(a) for a in fn.args)
        return f"partial({_describe(fn.func)}{', ' if args else ''}{args}" \
               f"{', ' if kw else ''}{kw})"
    if hasattr(fn, "__dataclass_fields__"):
        return repr(fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclass(frozen=True, eq=False)
class OptimizerSpec:
    """What every device builds its optimizer from: the factory, the parameter groups (each
    a tuple of name patterns and its settings; a parameter takes the first group it matches,
    the factory's defaults otherwise) and the learning-rate scheduler factory."""

    factory: Callable
    groups: tuple[tuple[tuple[str, ...], tuple[tuple[str, object], ...]], ...] = ()
    scheduler: Callable | None = None

    # -- groups --
    def group_of(self, name: str) -> int:
        """Index of `name`'s group; len(groups) is the default group."""
        return _group_of(self.groups, name)

    def check_patterns(self, names, where: str) -> None:
        """PlanError naming a `param_groups` group none of whose patterns matches any of
        `names` (a typo such as `"*.bais"` would otherwise leave its settings unused,
        silently). A group listing several patterns may hold some that match nothing here
        (a no-decay list naming norms a model lacks), as torch recipes do."""
        names = list(names)
        prefixes = {p for n in names for p in
                    [n] + [n.rsplit(".", k)[0] for k in range(1, n.count(".") + 1)]}
        for i, (patterns, _) in enumerate(self.groups):
            if any(fnmatch.fnmatchcase(p, pat) for pat in patterns for p in prefixes):
                continue
            close = [c for pat in patterns
                     for c in difflib.get_close_matches(pat, sorted(prefixes), n=1)]
            hint = f" (did you mean {close[0]!r}?)" if close else \
                f" (names look like {', '.join(repr(n) for n in names[:3])})"
            shown = ", ".join(repr(p) for p in patterns)
            raise PlanError(f"{where}: param_groups[{i}] pattern {shown} matches no "
                            f"parameter or module{hint}; fix or remove it")

    def build(self, params_per_group: list[list] | None = None):
        """(optimizer, scheduler or None) over `params_per_group` (one list per group, the
        default group last); without it, over one empty placeholder per group (a device
        rebinds the tensors it updates at each update, see `runtime.update`)."""
        if params_per_group is None:
            params_per_group = [[torch.nn.Parameter(torch.zeros(0, 0))]
                                for _ in range(len(self.groups) + 1)]
        spec = [{"params": ps, **dict(opts)}
                for ps, (_, opts) in zip(params_per_group, [*self.groups, ((), ())], strict=True)]
        spec = [g for g in spec if g["params"]] or spec[-1:]
        opt = self.factory(spec)
        sched = self.scheduler(opt) if self.scheduler is not None else None
        return opt, sched

    @functools.cached_property
    def cls_name(self) -> str:
        opt, _ = self.build()
        return type(opt).__name__

    @functools.cached_property
    def elementwise(self) -> bool:
        """True when updating flat pieces of a parameter equals updating it whole."""
        if self.cls_name in ELEMENTWISE:
            return True
        if self.cls_name in NOT_ELEMENTWISE:
            return False
        return _probe_elementwise(self)

    def requires_whole(self) -> str | None:
        """Why this optimizer cannot update ZeRO shards (None when it can)."""
        if self.elementwise:
            return None
        return NOT_ELEMENTWISE.get(self.cls_name, "does not update each element on its own "
                                   "(a step on a matrix differs from steps on its flat pieces)")

    # -- memory --
    def state_bytes(self, shape: tuple[int, ...], dtype: str = "float32", group: int = 0) -> int:
        """Bytes of optimizer state one tensor of `shape` keeps after its first update."""
        return _state_bytes(self, tuple(shape), dtype, group)

    def per_element(self) -> float:
        """State bytes per element of a large 1-D tensor (the analytic memory figure)."""
        n = 1 << 16
        return (self.state_bytes((2 * n,)) - self.state_bytes((n,))) / n

    # -- records and transport --
    def record(self) -> dict:
        return {"factory": _describe(self.factory),
                "groups": [[list(p), {k: repr(v) for k, v in o}] for p, o in self.groups],
                "scheduler": None if self.scheduler is None else _describe(self.scheduler)}

    def __reduce__(self):   # lambdas and closures travel to workers by value
        import cloudpickle
        return (_load, (cloudpickle.dumps((self.factory, self.groups, self.scheduler)),))

    def __repr__(self) -> str:
        return f"OptimizerSpec({self.record()})"


def _load(blob: bytes) -> OptimizerSpec:
    import pickle
    return OptimizerSpec(*pickle.loads(blob))


@functools.lru_cache(maxsize=4096)
def _group_of(groups, name: str) -> int:
    prefixes = [name] + [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
    for i, (patterns, _) in enumerate(groups):
        if any(fnmatch.fnmatchcase(p, pat) for pat in patterns for p in prefixes):
            return i
    return len(groups)


@functools.lru_cache(maxsize=4096)
def _state_bytes(spec: OptimizerSpec, shape: tuple, dtype: str, group: int) -> int:
    """One update of a tensor of `shape` on the meta device (nothing allocated); a small
    real tensor when the optimizer reads values (`.item()`), which meta tensors lack."""
    for device in ("meta", "cpu"):
        if device == "cpu" and math.prod(shape) > 1 << 22:
            break
        p = torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype), device=device))
        p.grad = torch.ones_like(p)
        groups = [[] for _ in range(len(spec.groups) + 1)]
        groups[min(group, len(spec.groups))].append(p)
        opt, _ = spec.build(groups)
        try:
            opt.step()
        except (RuntimeError, NotImplementedError):
            continue
        return sum(t.numel() * t.element_size() for t in opt.state[p].values()
                   if isinstance(t, torch.Tensor))
    raise PlanError(f"cannot size the state of {spec.cls_name} for a tensor of shape "
                    f"{list(shape)} without running it; pass MemorySettings(optim_bytes=...)")


def _probe_elementwise(spec: OptimizerSpec) -> bool:
    """Two updates of a 4x6 matrix against the same updates of its two flat pieces."""
    g = torch.Generator().manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(4, 6, generator=g))
    pieces = [torch.nn.Parameter(whole.detach().reshape(-1)[a:b].clone()) for a, b in
              ((0, 10), (10, 24))]
    opt_w, _ = spec.build([[] for _ in spec.groups] + [[whole]])
    opt_p, _ = spec.build([[] for _ in spec.groups] + [pieces])
    for _ in range(2):
        grad = torch.randn(4, 6, generator=g)
        whole.grad = grad.clone()
        for p, (a, b) in zip(pieces, ((0, 10), (10, 24)), strict=True):
            p.grad = grad.reshape(-1)[a:b].clone()
        opt_w.step()
        opt_p.step()
    return torch.equal(whole.detach().reshape(-1), torch.cat([p.detach() for p in pieces]))


def shard_pieces(sizes: Iterable[tuple[str, int]], shard: int, position: int,
                 group_of: Callable[[str], int]) -> list[tuple[str, int, int, int]]:
    """The pieces of shard `position` of a flat bucket holding `sizes` ((name, numel) in
    order): maximal runs of parameters of one group, as (first name, start, stop, group)
    with start/stop offsets inside the shard. Padding belongs to no piece."""
    lo, hi = position * shard, (position + 1) * shard
    out: list[list] = []
    off = 0
    for name, n in sizes:
        a, b = max(off, lo), min(off + n, hi)
        off += n
        if a >= b:
            continue
        g = group_of(name)
        if out and out[-1][3] == g and out[-1][2] == a - lo:
            out[-1][2] = b - lo
        else:
            out.append([name, a - lo, b - lo, g])
    return [tuple(p) for p in out]


def check_optimizer(optimizer, where: str = "train", *, param_groups=None,
                    lr_scheduler=None) -> OptimizerSpec:
    """The optimizer, its parameter groups and scheduler as one `OptimizerSpec`, checked by
    building them once here (a PlanError before any worker starts, not at the first update)."""
    groups = None
    if isinstance(optimizer, OptimizerSpec):   # what is given replaces only its own part
        if param_groups is None and lr_scheduler is None:
            return optimizer
        groups = optimizer.groups if param_groups is None else None
        lr_scheduler = optimizer.scheduler if lr_scheduler is None else lr_scheduler
        optimizer = optimizer.factory
    if isinstance(optimizer, type) and issubclass(optimizer, (SGD, AdamW)):
        raise PlanError(f"{where}: optimizer=pn.optim.{optimizer.__name__} is the class; pass "
                        f"an instance such as pn.optim.{optimizer.__name__}(lr=1e-3)")
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__
        raise PlanError(f"{where}: optimizer is a torch.optim.{name} instance, bound to this "
                        "process's parameters; pass a factory that builds one from parameters, "
                        f"e.g. functools.partial(torch.optim.{name}, lr=...)")
    if not callable(optimizer):
        raise PlanError(f"{where}: optimizer must build a torch.optim optimizer from parameters "
                        "(functools.partial(torch.optim.AdamW, lr=3e-4), pn.optim.AdamW(lr=...)),"
                        f" got {type(optimizer).__module__}.{type(optimizer).__name__}")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise PlanError(f"{where}: lr_scheduler must build a scheduler from the optimizer, e.g. "
                        "lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)")
    spec = OptimizerSpec(optimizer, _groups(param_groups, where) if groups is None else groups,
                         lr_scheduler)
    try:
        opt, sched = spec.build()
    except Exception as err:   # the user's factory: say which part failed and how
        raise PlanError(f"{where}: building the optimizer (or its scheduler) failed: "
                        f"{type(err).__name__}: {err}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise PlanError(f"{where}: optimizer(params) returned a {type(opt).__name__}, not a "
                        "torch.optim.Optimizer")
    why = REFUSED.get(type(opt).__name__)
    if why:
        raise PlanError(f"{where}: torch.optim.{type(opt).__name__} {why}; use another optimizer")
    _check_group_keys(spec, opt, where)
    if sched is not None and not callable(getattr(sched, "step", None)):
        raise PlanError(f"{where}: lr_scheduler(optimizer) returned a {type(sched).__name__} "
                        "without step()")
    return spec


def _groups(param_groups, where: str) -> tuple:
    out = []
    for i, g in enumerate(param_groups or ()):
        if not isinstance(g, dict) or "params" not in g:
            raise PlanError(f"{where}: param_groups[{i}] must be a dict with 'params' (a name "
                            "pattern or a list of them) and settings, e.g. {'params': ['*norm*', "
                            "'*.bias'], 'weight_decay': 0.0}")
        pats = g["params"]
        pats = (pats,) if isinstance(pats, str) else tuple(pats)
        if not pats or not all(isinstance(p, str) for p in pats):
            raise PlanError(f"{where}: param_groups[{i}]['params'] must be name patterns "
                            f"(strings like '*.bias'), got {g['params']!r}")
        opts = tuple(sorted((k, copy.deepcopy(v)) for k, v in g.items() if k != "params"))
        out.append((pats, opts))
    return tuple(out)


def _check_group_keys(spec: OptimizerSpec, opt: torch.optim.Optimizer, where: str) -> None:
    known = set(opt.defaults)
    for i, (pats, opts) in enumerate(spec.groups):
        bad = [k for k, _ in opts if k not in known]
        if bad:
            raise PlanError(f"{where}: param_groups[{i}] ({', '.join(pats)}) sets {bad[0]!r}, "
                            f"which {type(opt).__name__} does not have; it has "
                            f"{', '.join(sorted(known))}")
