"""StageGraph: a model whose stages form a DAG, for checking strategies on awkward models.

Real models are not chains: an encoder's output is read by every decoder layer, U-Nets
and DenseNets skip ahead, embeddings are tied to the output head, some layers are frozen,
BatchNorm keeps running statistics, a module is called twice, a layer applies a custom
autograd Function, some layers are in eval mode. `StageGraph(GraphSpec(...))`
builds such a model from a small description, one `stages.i` module per pipeline stage,
and `GraphSpec.draw(rng, stages)` draws a random one (the differential fuzzer in
`tests/fuzz` does). Everything is seeded; `annotation()` tags stage i with `PP: i`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import seeded

__all__ = ["GraphSpec", "StageGraph", "ACTIVATIONS", "StraightClamp"]

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "sigmoid": nn.Sigmoid,
               "silu": nn.SiLU, "identity": nn.Identity}


@dataclass(frozen=True, kw_only=True)
class GraphSpec:
    """What a StageGraph computes. Stage i adds the outputs of stage i-1 (the batch for
    stage 0) and of its `skips` sources, applies its Linear (its own weight, or stage a's
    when tied), then its BatchNorm, constant scale buffer, self-attention (`attns`, on
    sequences), MLP (`mlps`), activation and dropout."""

    stages: int = 4                              # stages.0 .. stages.{stages-1}
    dim: int = 8                                 # features everywhere
    skips: tuple[tuple[int, int], ...] = ()      # (a, b): stage b also reads stage a (a < b-1)
    acts: tuple[str, ...] = ()                   # per stage, a key of ACTIVATIONS (tanh)
    act_modules: bool = False                    # activations as untagged top-level modules
    ties: tuple[tuple[int, int], ...] = ()       # (a, b): stage b uses stage a's weight
    frozen: tuple[int, ...] = ()                 # stages whose Linear does not train
    norms: tuple[int, ...] = ()                  # stages with a BatchNorm1d
    scales: tuple[int, ...] = ()                 # stages scaled by a constant buffer
    dropout: float = 0.0                         # after every stage (and in its MLP)
    shared: tuple[int, int] | None = None        # (a, b): `shared` runs after stages a and b
    functions: tuple[int, ...] = ()              # stages clamped by `StraightClamp` after their Linear
    eval_stages: tuple[int, ...] = ()            # stages in eval mode (BatchNorm on running stats)
    eval_dropout: bool = False                   # the dropout module in eval mode (off)
    mlps: tuple[int, ...] = ()                   # stages adding an MLP x + down(tanh(up(x)))
    attns: tuple[int, ...] = ()                  # stages adding self-attention (sequences)
    classes: int = 0                             # > 0: a classifier `head` and cross-entropy
    smoothing: float = 0.0                       # the cross-entropy's label smoothing
    seed: int = 0

    def __post_init__(self):
        n = self.stages
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"GraphSpec: stages must be a positive int, got {n!r}")
        for a, b in self.skips:
            if not 0 <= a < b - 1 < n - 1:
                raise ValueError(f"GraphSpec: skip ({a}, {b}) must go forward past the next "
                                 f"stage, within 0..{n - 1}")
        for a, b in self.ties:
            if not 0 <= a < b < n:
                raise ValueError(f"GraphSpec: tie ({a}, {b}) needs 0 <= a < b < {n}")
        if self.acts and (len(self.acts) != n or set(self.acts) - set(ACTIVATIONS)):
            raise ValueError(f"GraphSpec: acts needs one of {sorted(ACTIVATIONS)} per stage")
        if self.shared is not None and not 0 <= self.shared[0] < self.shared[1] < n:
            raise ValueError(f"GraphSpec: shared ({self.shared}) needs 0 <= a < b < {n}")
        for name in ("functions", "eval_stages", "mlps", "attns"):
            bad = [i for i in getattr(self, name) if not 0 <= i < n]
            if bad:
                raise ValueError(f"GraphSpec: {name} {bad} are not stages 0..{n - 1}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GraphSpec: dropout must be in [0, 1), got {self.dropout}")
        if self.classes < 0 or not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"GraphSpec: classes ({self.classes}) must be >= 0 and smoothing "
                             f"({self.smoothing}) in [0, 1)")

    @classmethod
    def draw(cls, rng: random.Random, stages: int, *, norms: bool = True,
             dropout: bool = False, shared: bool = True) -> GraphSpec:
        """A random spec over `stages` stages: skip edges from any earlier stage, ties
        between any two stages, frozen stages, buffers, a mix of activations, maybe a
        module called from two stages."""
        pairs = [(a, b) for b in range(stages) for a in range(b - 1)]
        skips = tuple(sorted(rng.sample(pairs, rng.randint(0, min(3, len(pairs))))))
        tie_pairs = [(a, b) for b in range(stages) for a in range(b)]
        ties: list[tuple[int, int]] = []
        for a, b in rng.sample(tie_pairs, min(len(tie_pairs), rng.choice([0, 0, 1, 2]))):
            if all(b not in t and a != t[1] for t in ties):   # one weight per chain of ties
                ties.append((a, b))
        pick = lambda p: tuple(i for i in range(stages) if rng.random() < p)
        share = None
        if shared and stages >= 2 and rng.random() < 0.25:
            a = rng.randrange(stages - 1)
            share = (a, rng.randrange(a + 1, stages))
        frozen = pick(0.15)
        tied_to = {b: a for a, b in ties}
        if {tied_to.get(i, i) for i in range(stages)} <= {tied_to.get(i, i) for i in frozen}:
            frozen = ()   # something must train
        return cls(stages=stages, dim=rng.choice([4, 8]), skips=skips,
                   acts=tuple(rng.choice(list(ACTIVATIONS)) for _ in range(stages)),
                   act_modules=rng.random() < 0.3, ties=tuple(ties),
                   frozen=frozen, norms=pick(0.25) if norms else (), scales=pick(0.2),
                   dropout=rng.choice([0.1, 0.3]) if dropout else 0.0, shared=share,
                   seed=rng.randrange(2**31))


class StraightClamp(torch.autograd.Function):
    """Clamps to [-1, 1] forward; passes the gradient through unchanged backward (a
    straight-through estimator): its backward is not the gradient of its forward."""

    @staticmethod
    def forward(ctx, h):
        return h.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Attention(nn.Module):
    """x + proj(softmax(q k^T / sqrt(d)) v) over 4 heads, on [batch, sequence, dim]."""

    HEADS = 4

    def __init__(self, dim: int):
        super().__init__()
        # no bias on q, k, v: a key's bias shifts every score of a query alike, so softmax
        # gives it a zero gradient, which Adam-like optimizers would turn into steps of noise
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.head_dim = dim // self.HEADS

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s = h.shape[0], h.shape[1]   # heads as -1: a device's share under TP
        q, k, v = (z.reshape(b, s, -1, self.head_dim).transpose(1, 2)
                   for z in self.qkv(h).chunk(3, dim=-1))
        att = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1)
        return h + self.proj((att @ v).transpose(1, 2).reshape(b, s, -1))


class _Stage(nn.Module):
    def __init__(self, dim: int, norm: bool, scale: bool, mlp: bool = False,
                 dropout: float = 0.0, attn: bool = False):
        super().__init__()
        self.attn = _Attention(dim) if attn else None
        self.lin = nn.Linear(dim, dim, bias=not norm)   # BatchNorm's shift makes a bias moot
        self.norm = nn.BatchNorm1d(dim) if norm else None
        if scale:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        else:
            self.scale = None
        self.up = nn.Linear(dim, 2 * dim) if mlp else None     # a pair to shard (TP)
        self.down = nn.Linear(2 * dim, dim) if mlp else None
        # on the MLP's hidden activation: a device's share of it under TP
        self.hidden_drop = nn.Dropout(dropout) if mlp and dropout else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.norm is not None:
            h = self.norm(h)
        h = h * self.scale if self.scale is not None else h
        if self.attn is not None:
            h = self.attn(h)
        if self.up is None:
            return h
        hidden = torch.tanh(self.up(h))
        if self.hidden_drop is not None:
            hidden = self.hidden_drop(hidden)
        return h + self.down(hidden)


class StageGraph(nn.Module):
    """The model a GraphSpec describes; regression on a fixed random teacher (MSE), or with
    `classes` its classification (a head, cross-entropy)."""

    def __init__(self, spec: GraphSpec):
        super().__init__()
        self.spec = spec
        self.config = {"stages": spec.stages, "dim": spec.dim}
        with seeded(spec.seed):
            self.stages = nn.ModuleList(
                _Stage(spec.dim, i in spec.norms, i in spec.scales, i in spec.mlps,
                       spec.dropout, i in spec.attns)
                for i in range(spec.stages))
            self.shared = nn.Linear(spec.dim, spec.dim) if spec.shared else None
            self.head = nn.Linear(spec.dim, spec.classes) if spec.classes else None
        for a, b in spec.ties:
            self.stages[b].lin.weight = self.stages[a].lin.weight
        for i in spec.frozen:
            self.stages[i].lin.requires_grad_(False)
        acts = spec.acts or ("tanh",) * spec.stages
        self.act = (nn.ModuleList(ACTIVATIONS[a]() for a in acts) if spec.act_modules else None)
        self._acts = acts
        self.drop = nn.Dropout(spec.dropout) if spec.dropout else None
        for i in spec.eval_stages:
            self.stages[i].eval()
        if self.drop is not None and spec.eval_dropout:
            self.drop.eval()
            for stage in self.stages:
                if stage.hidden_drop is not None:
                    stage.hidden_drop.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec, outs, h = self.spec, [], x
        for i, stage in enumerate(self.stages):
            for a, b in spec.skips:
                if b == i:
                    h = h + outs[a]
            h = stage(h)
            if i in spec.functions:
                h = StraightClamp.apply(h)
            h = self.act[i](h) if self.act is not None else _ACT_FN[self._acts[i]](h)
            if self.drop is not None:
                h = self.drop(h)
            if spec.shared and i in spec.shared:
                h = h + torch.tanh(self.shared(h))
            outs.append(h)
        return self.head(h) if self.head is not None else h

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """MSE on the teacher's outputs; with `classes`, cross-entropy on its classes."""
        if self.head is None:
            return F.mse_loss(output, targets)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1),
                               label_smoothing=self.spec.smoothing)

    @property
    def tp_plan(self) -> dict[str, str]:
        """How `pn.tensor_parallel` shards it: each MLP's `up` by output, `down` by input,
        each attention's fused `qkv` by heads and `proj` by input; the classifier head by
        class (its loss then vocabulary-parallel)."""
        plan = {k: v for i in self.spec.mlps
                for k, v in ((f"stages.{i}.up", "colwise"), (f"stages.{i}.down", "rowwise"))}
        plan |= {k: v for i in self.spec.attns for k, v in (
            (f"stages.{i}.attn.qkv", "colwise:3"), (f"stages.{i}.attn.proj", "rowwise"))}
        return plan | ({"head": "colwise_gather_output"} if self.head is not None else {})

    def annotation(self) -> dict[str, dict[str, int]]:
        """Stage i is `PP: i`; `shared` belongs to the first stage that calls it, the
        classifier head to the last."""
        out = {f"stages.{i}": {"PP": i} for i in range(self.spec.stages)}
        if self.spec.shared:
            out["shared"] = {"PP": self.spec.shared[0]}
        if self.head is not None:
            out["head"] = {"PP": self.spec.stages - 1}
        return out

    def example_batch(self, batch_size: int, seed: int = 0, length: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of `batch_size` samples; with `length`, each sample a sequence
        of `length` vectors (no BatchNorm stage then: it normalizes (N, dim) batches)."""
        g = torch.Generator().manual_seed(seed)
        shape = (batch_size, self.spec.dim) if length is None else (batch_size, length,
                                                                    self.spec.dim)
        x = torch.randn(*shape, generator=g)
        w = torch.randn(self.spec.dim, self.spec.dim, generator=g) / self.spec.dim ** 0.5
        y = torch.tanh(x @ w)
        if self.spec.classes:   # the teacher's class: the largest of `classes` projections
            y = (y @ torch.randn(self.spec.dim, self.spec.classes, generator=g)).argmax(-1)
        return x, y


_ACT_FN = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid,
           "silu": F.silu, "identity": lambda h: h}
