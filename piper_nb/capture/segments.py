"""Assign the fx nodes of a traced model to regions: one region per (tags, segment).

An op with tags of its own joins the region of those tags, in the segment that
`_RegionGraph.segment` works out from the regions it reads; glue (functions, methods,
untagged modules without parameters) joins the latest region among its inputs, or, when
it reads none, the earliest region among its users; a tagged op on parameters only
(`w.transpose`) whose users all sit in one later segment of its tags moves there. Regions
are then numbered in dependency order and a re-entered tag combination gets a SEG tag.
Used by `capture.split`.
"""

from __future__ import annotations

import heapq
import re

import torch.fx as fx

from piper_nb.errors import PlanError
from piper_nb.ir.filters import SEG, Tags, freeze_tags, tags_text

__all__ = ["assign_regions"]


class _RegionGraph:
    """Regions created while walking the fx graph: key (tags, segment) and direct inputs."""

    def __init__(self):
        self.keys: list[tuple[Tags, int]] = []
        self.index: dict[tuple[Tags, int], int] = {}
        self.deps: list[set[int]] = []
        self._anc: dict[int, frozenset[int]] = {}

    def get(self, key: tuple[Tags, int]) -> int:
        if key not in self.index:
            self.index[key] = len(self.keys)
            self.keys.append(key)
            self.deps.append(set())
        return self.index[key]

    def depend(self, r: int, srcs) -> None:
        new = {s for s in srcs if s != r} - self.deps[r]
        if new:
            self.deps[r] |= new
            self._anc.clear()

    def ancestors(self, r: int) -> frozenset[int]:
        """Regions `r` depends on, transitively, `r` included."""
        if r not in self._anc:
            seen, todo = {r}, [r]
            while todo:
                for s in self.deps[todo.pop()]:
                    if s not in seen:
                        seen.add(s)
                        todo.append(s)
            self._anc[r] = frozenset(seen)
        return self._anc[r]

    def segment(self, tags: Tags, srcs: set[int]) -> int:
        """Segment of an op tagged `tags` reading regions `srcs`: the segment of an input
        region with the same tags, or one past every segment of `tags` the inputs depend on."""
        seg = 0
        for a in srcs:
            a_tags, a_seg = self.keys[a]
            if a_tags == tags:
                seg = max(seg, a_seg)
            else:
                seg = max([seg, *(self.keys[x][1] + 1 for x in self.ancestors(a)
                                  if x != a and self.keys[x][0] == tags)])
        return seg

    def latest(self, rs: set[int], last: bool = True) -> int:
        """The region of `rs` no other one depends on (`last`) or depends on no other one;
        ties go to the latest (earliest) created."""
        if last:
            free = [r for r in rs if not any(r in self.ancestors(o) for o in rs if o != r)]
            return max(free or rs)
        free = [r for r in rs if not any(o in self.ancestors(r) for o in rs if o != r)]
        return min(free or rs)

    def topological(self) -> list[int]:
        """Region indices in dependency order, ties by creation (the identity when creation
        order is already topological)."""
        users: dict[int, list[int]] = {r: [] for r in range(len(self.keys))}
        indeg = [len(d) for d in self.deps]
        for r, ds in enumerate(self.deps):
            for s in ds:
                users[s].append(r)
        heap = [r for r, k in enumerate(indeg) if k == 0]
        heapq.heapify(heap)
        out = []
        while heap:
            r = heapq.heappop(heap)
            out.append(r)
            for u in users[r]:
                indeg[u] -= 1
                if not indeg[u]:
                    heapq.heappush(heap, u)
        if len(out) != len(self.keys):
            left = [tags_text(self.keys[r][0]) for r in range(len(self.keys)) if r not in out]
            raise PlanError(f"regions {', '.join(left)} depend on each other in a cycle; tag the "
                            "operations between them so each region runs in one piece")
        return out


# operations that join a region by their data: functions, methods and untagged modules
# without parameters (an `nn.ReLU()` called between tagged layers, as torchvision's ResNet
# does), which take the tags of their caller as functional ops do
_GLUE = frozenset({"call_function", "call_method", "call_module"})


def assign_regions(nodes: list[fx.Node], own: dict[fx.Node, dict],
                    ) -> tuple[dict[fx.Node, int], dict[int, Tags]]:
    """fx node -> region index (topological order) and region index -> tags (SEG added)."""
    graph = _RegionGraph()
    region_of: dict[fx.Node, int] = {}
    weights: set[fx.Node] = set()   # ops on parameters and constants only (`w.transpose`)
    for n in nodes:
        srcs = {region_of[a] for a in n.all_input_nodes if a in region_of}
        if n.op in _GLUE and all(a.op == "get_attr" or a in weights for a in n.all_input_nodes):
            weights.add(n)
        if n in own:
            tags = freeze_tags(own[n])
            r = graph.get((tags, graph.segment(tags, srcs)))
        elif n.op in _GLUE and srcs:
            r = graph.latest(srcs)
        else:
            continue
        region_of[n] = r
        graph.depend(r, srcs)
    _follow_users(nodes, weights, region_of, graph)
    out = nodes[-1] if nodes and nodes[-1].op == "output" else None
    flat = out.args[0] if out is not None else ()
    loss = flat[0] if isinstance(flat, (tuple, list)) else flat
    for n in reversed(nodes):
        if n.op in _GLUE and n not in region_of:
            users = {region_of[u] for u in n.users if u in region_of}
            if not users and out in n.users and loss in region_of:
                users = {region_of[loss]}   # a count or metric from the targets alone
            if not users:
                raise PlanError(f"operation {n.name} ({n.target}){_where(n)} belongs to no "
                                "region: it reads no tagged value and no region or loss reads "
                                "it; tag the module that computes it, or move it out of "
                                "forward (a buffer update belongs in a hook or the loop)")
            region_of[n] = r = graph.latest(users, last=False)
            for u in users:
                graph.depend(u, {r})
    number = {r: i for i, r in enumerate(graph.topological())}
    tags_of_region: dict[int, Tags] = {}
    for r, (tags, seg) in enumerate(graph.keys):
        if seg:
            if SEG in dict(tags):
                raise PlanError(f"region {tags_text(tags)} is re-entered after regions that "
                                f"depend on it and needs a segment tag, but {SEG} is a tag of "
                                "the model: rename that tag (piper_nb sets SEG)")
            tags = freeze_tags({**dict(tags), SEG: seg})
        tags_of_region[number[r]] = tags
    return {n: number[r] for n, r in region_of.items()}, tags_of_region


def _where(n: fx.Node) -> str:
    """' in <module path> forward at file:line (code)', from the node's recorded stack."""
    stack = n.meta.get("nn_module_stack") or {}
    path, kind = list(stack.values())[-1][:2] if stack else ("", "")
    path = path.removeprefix("model").removeprefix(".")   # export's root holds the model
    kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1].strip("'>")
    scope = f" in {path or 'the root'} forward ({kind})"
    lines = (n.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m and "/torch/" not in m["file"] and "/piper_nb/" not in m["file"]:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{scope} at {m['file']}:{m['line']} ({code})"
    return scope if stack else ""


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def _follow_users(nodes: list[fx.Node], weights: set[fx.Node], region_of: dict[fx.Node, int],
                  graph: _RegionGraph) -> None:
    """A tagged op on parameters only (`w.transpose` before a grouped matmul) whose users
    all sit in one later segment of its tags moves there, so a weight is not sent from the
    tags' first segment to the segment that reads it (sliced experts of several layers)."""
    size: dict[int, int] = {}
    for r in region_of.values():
        size[r] = size.get(r, 0) + 1
    for n in reversed(nodes):
        if n not in weights or n not in region_of:
            continue
        users = {region_of.get(u) for u in n.users}
        if len(users) != 1:
            continue
        r, old = next(iter(users)), region_of[n]
        if (r is not None and r != old and size[old] > 1
                and graph.keys[r][0] == graph.keys[old][0]):
            region_of[n] = r
            size[old] -= 1
            size[r] += 1
