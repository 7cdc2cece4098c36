"""The strategy matrix piper_nb checks itself against, built by name.

Small models (an MLP, TinyGPT, TinyMoE) with every ZeRO level, every pipeline schedule and
expert parallelism on 2-4 devices: the memory-model-equals-runtime test, the accuracy
benchmark and the pinning benchmark all use these, so they speak of the same plans. Each
strategy comes in two sizes: `"test"` (the default; steps of a few milliseconds, all
overhead) and `"bench"` (the same plans over wider layers and bigger batches, so that a
step is mostly compute, as in real training).

It ships with the package, rather than living in `tests/`, because the benchmarks and the
figures in `benchmarks/RESULTS.md` are built from it: a user reproduces them with
`compile_strategy(name)` without a checkout of the tests.
"""

from __future__ import annotations

from collections.abc import Callable

from piper_nb import models, schedules
from piper_nb.capture import annotate, cut_stages
from piper_nb.compiler.compile import compile
from piper_nb.directives.spec import Program, place, replicate, shard, split
from piper_nb.tp import tensor_parallel

__all__ = ["MATRIX", "SIZES", "compile_strategy", "moe_annotation"]


def moe_annotation(layers: int, experts: int, stages: int) -> dict[str, dict[str, int]]:
    """TinyMoE's blocks cut evenly into `stages` PP stages, expert e of every block EP=e."""
    per = layers // stages
    mapping = {"embed": {"PP": 0}, "head": {"PP": stages - 1}}
    mapping |= {f"blocks.{i}": {"PP": i // per} for i in range(layers)}
    mapping |= {f"blocks.*.moe.experts.{e}": {"EP": e} for e in range(experts)}
    return mapping


SIZES = {  # size -> (MLP dim, MLP batch, TinyGPT vocab, dim, seq, batch per 8 of "test")
    "test": (16, 8, 64, 32, 16, 8),
    "bench": (512, 512, 512, 192, 64, 16),
}


def _mlp(size: str):
    dim, batch = SIZES[size][:2]
    model = models.MLP(dim=dim, depth=4)
    return model, model.example_batch(batch_size=batch, seed=0)


def _gpt(size: str, tied: bool = False, layers: int = 4, batch: int = 8):
    vocab, dim, seq, per8 = SIZES[size][2:]
    model = models.TinyGPT(vocab=vocab, dim=dim, layers=layers, heads=2, seq=seq,
                           tie_embeddings=tied)
    return model, model.example_batch(batch_size=batch * per8 // 8, seed=0)


def _pp(stages: int = 2) -> list:
    return [place({"PP": s}, [s]) for s in range(stages)]


def _schedule(name: str) -> list:
    return [*_pp(), Program([{"op": "schedule", "name": name, "ranks": 2, "microbatches": 4}])[0]]


def _zero(z: int, reshard: bool = True) -> Callable:
    return lambda size="test": (*_mlp(size), {"layers": {"PP": 0}},
                    [replicate({}, [0, 1], zero=z, reshard=reshard), split({}, "MB", 2)])


def _moe(size: str):
    """TinyMoE, top-1 over 2 experts: every replica routes a different number of tokens."""
    vocab, dim, seq, per8 = SIZES[size][2:]
    model = models.TinyMoE(vocab=vocab, dim=dim, layers=2, experts=2, top_k=1, heads=2, seq=seq)
    return model, model.example_batch(batch_size=per8, seed=0)


def _pp2_dp2_ep2(size: str) -> tuple:
    """PP 2 x DP 2 x EP 2 on 4 devices: each stage replicated over two devices, its
    experts sharded over the same two, 1F1B over 4 microbatches."""
    program = [place({"PP": 0}, [0, 2]), place({"PP": 1}, [1, 3]),
               replicate({"PP": 0}, [0, 2]), replicate({"PP": 1}, [1, 3]),
               shard({"PP": 0, "EP": "*"}, [0, 2]), shard({"PP": 1, "EP": "*"}, [1, 3]),
               *schedules.one_f_one_b(ranks=2, microbatches=4)]
    return (*_moe(size), moe_annotation(2, 2, 2), program)


PP2_DP2_ZERO3 = [  # the same program as examples/pp2_dp2_zero3.json
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
    {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "zero": 3},
    {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3], "zero": 3},
    {"op": "schedule", "name": "1f1b", "ranks": 2, "microbatches": 4},
]

PP2_TP2 = [  # Megatron's device order: each stage's TP group, then the next stage
    place({"PP": 0}, [0]), place({"PP": 1}, [2]),
    tensor_parallel({"PP": 0}, [0, 1]), tensor_parallel({"PP": 1}, [2, 3]),
    *schedules.one_f_one_b(ranks=2, microbatches=4)]

# name -> (size) -> (model, batch, annotation (None: 2 stages; an int: that many), program)
MATRIX: dict[str, Callable[..., tuple]] = {
    **{f"zero{z}": _zero(z) for z in range(4)},
    "zero3-noreshard": _zero(3, reshard=False),
    "gpipe": lambda size="test": (*_mlp(size), None, _schedule("gpipe")),
    "1f1b": lambda size="test": (*_mlp(size), None, _schedule("1f1b")),
    "interleaved": lambda size="test": (
        *_gpt(size, layers=6), 4, schedules.interleaved_1f1b(2, 4, chunks=2, place=True)),
    "zb1p": lambda size="test": (
        *_gpt(size, layers=6), None, [*_pp(), *schedules.zero_bubble(ranks=2, microbatches=4)]),
    "dualpipev": lambda size="test": (
        *_gpt(size, layers=6), 4, schedules.dualpipev(ranks=2, microbatches=4, place=True)),
    "dualpipe-4ranks": lambda size="test": (
        *_gpt(size, layers=6, batch=16), 4,
        schedules.dualpipe(ranks=4, microbatches=8, place=True)),
    "pp2-dp2-zero3": lambda size="test": (*_gpt(size), None, Program(PP2_DP2_ZERO3)),
    "pp2-dp2-ep2": _pp2_dp2_ep2,
    "tied-embeddings": lambda size="test": (
        *_gpt(size, tied=True), None, [*_pp(), *schedules.one_f_one_b(ranks=2, microbatches=4)]),
    "pp2-tp2": lambda size="test": (*_gpt(size), None, PP2_TP2),
    "tp2-dp2-zero3": lambda size="test": (*_gpt(size), {"": {"PP": 0}}, [
        replicate({}, [0, 2], zero=3), tensor_parallel({}, [[0, 1], [2, 3]]),
        split({}, "MB", 2)]),
}


def compile_strategy(name: str, size: str = "test"):
    """-> (plan, batch) of one strategy of the matrix, at `size` ("test" or "bench")."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    model, batch, annotation, program = MATRIX[name](size)
    if not isinstance(annotation, dict):
        annotation = cut_stages(model, annotation or 2)
    return compile(annotate(model, annotation), program, batch), batch
