"""The regions around a context cut: which region each was cut from (tensor parallelism
cuts first, into parts that the context cut cuts again, `origins_of`), and the values the
rewrite left unread (a causal mask made in one region for another's attention, which ring
attention no longer reads: `drop_unread`), with the ops that made them (`prune`).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

__all__ = ["origins_of", "drop_unread", "prune"]


def origins_of(capture) -> list[tuple[int, int | None]]:
    """Per region: (the region it was cut from, its tensor-parallel part there or None).
    Tensor parallelism cut regions into parts in order, so a region no part of is the one
    after the last one seen."""
    tp = capture.tp.parts if capture.tp is not None else None
    out, last = [], -1
    for r in capture.regions:
        if tp is None:
            out.append((r.index, None))
            continue
        last, part = tp[r.index] if r.index in tp else (last + 1, None)
        out.append((last, part))
    return out


def drop_unread(capture, modules: list) -> list:
    """The regions with the values the rewrite left unread taken out (a causal mask one
    region makes for another's attention, which ring attention no longer reads): out of
    the reader's inputs and the maker's outputs, and the ops that made them pruned."""
    regions, read = list(capture.regions), set()
    for k in reversed(range(len(regions))):
        info, g = regions[k], modules[k].graph
        out = next(n for n in g.nodes if n.op == "output")
        dead = [i for i, v in enumerate(info.outputs) if capture.consumers.get(v)
                and v not in read]
        if dead:
            ends = list(out.args[0])
            out.args = (tuple(a for i, a in enumerate(ends) if i not in dead),)
            prune(g, [ends[i] for i in dead if isinstance(ends[i], fx.Node)])
        phs = [n for n in g.nodes if n.op == "placeholder"]
        unread = [i for i, (ph, v) in enumerate(zip(phs, info.inputs, strict=True))
                  if not ph.users and capture.producer.get(v, -1) >= 0]
        for i in unread:
            g.erase_node(phs[i])
        if dead or unread:
            g.lint()
            modules[k].recompile()
            regions[k] = dataclasses.replace(
                info, outputs=tuple(v for i, v in enumerate(info.outputs) if i not in dead),
                inputs=tuple(v for i, v in enumerate(info.inputs) if i not in unread))
        read |= set(regions[k].inputs)
    return regions


def prune(g: fx.Graph, dead: list[fx.Node]) -> None:
    """Erase `dead` and what only they read, back to anything read elsewhere or impure."""
    gone: set[fx.Node] = set()
    while dead:
        n = dead.pop()
        if n in gone or n.users or n.op in ("placeholder", "output") or n.is_impure():
            continue
        ins = n.all_input_nodes
        g.erase_node(n)
        gone.add(n)
        dead.extend(a for a in ins if not a.users)
