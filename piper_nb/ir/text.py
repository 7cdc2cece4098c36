"""The text forms of piper_nb, and the one notation they share.

Four things are written as text; each number in them says what it counts.

**Schedule actions** (grids, `pn.schedules.*_grid`, `from_grid`, PyTorch's action CSV):
`{stage}{pass}{microbatch}`, PyTorch pipelining's form, unchanged. The leading number is a
*stage* (a `PP` index), never a region or a device.

    0F1       stage 0, forward, microbatch 1
    2B0       stage 2, full backward (inputs' and weights' gradients at once)
    1I3 1W3   stage 1's backward split in two: I for the inputs' gradients, W for the
              weights' (the filter `PASS` values BI and BW; I and W are PyTorch's letters)
    (0F3;3B1) one slot whose two actions may overlap (an F&B pair; PyTorch writes
              `(0F3;3B1)OVERLAP_F_B`, also accepted); `.` is an idle slot

A grid is one line of slots per rank (`rank 0: 0F0 0F1 0B0 ...`).

**Plan instructions** (`print(plan)`, `plan.grid()`, `print(plan[d])`, timeline labels):
what one device executes. A prefix says whose it is: `r{region}:` for a region's
instructions (a region is one unique tag combination, e.g. `{PP=0,EP=1}`; `print(plan)`
lists them), `b{bucket}:` for a collective over a parameter bucket. A trailing number is
always a microbatch.

    r0:F1           region 0, forward, microbatch 1      r0:B1  full backward
    r0:I1  r0:W1    backward split into input / weight gradients (PASS BI / BW)
    r0:U            region 0's optimizer update (once per step)
    r0:SEND_F1>2    send region 0's activations of microbatch 1 to device 2
    r1:RECV_B0<3    receive the gradients of region 1's outputs, microbatch 0, from device 3
    b0:AR           all-reduce bucket 0's gradients once per step (plain data parallel)
    b0:RS  b0:RS1   reduce-scatter bucket 0 once per step / after microbatch 1 (ZeRO-1..3)
    b0:AG           all-gather bucket 0's updated shards after the update (ZeRO-1, ZeRO-2)
    b0:AG@F1        all-gather bucket 0's parameters for the forward of microbatch 1
                    (ZeRO-3: one gather before every pass, so `b0:AG@F0 b0:AG@B0`)
    norm:AR         all-reduce of the squared gradient norm before the updates
                    (`clip_grad_norm`)
    count:AR        all-reduce of the global-batch loss's count before the updates
                    (`loss_mean="global"`)
    r1:AR_F0        tensor parallelism: all-reduce of the partial sums region 1 (a sharded
                    part) made in its forward of microbatch 0, over its TP group
    r1:AR_B0        the all-reduce of the gradient shares of region 1's inputs, backward
    r1:AG_R0        sequence parallelism: the all-gather again, before the backward, of
                    the slices region 1's forward kept of an input (`compiler.regather`)
    r0:DISPATCH_F1  all-to-all sending microbatch 1's tokens from region 0 to the experts
    r3:COMBINE_F1   all-to-all bringing the experts' outputs back to region 3
    r3:DISPATCH_B1  r0:COMBINE_B1   the same two exchanges carrying gradients, backwards
    wait(r0:RECV_B0<1)   block until that issued transfer is complete
    free(act:x@1)        release buffers (activation x of microbatch 1; `param:0` is
                         bucket 0's gathered parameters)

Communication is issued early on its own stream and waited for right before its consumer,
which is why `plan.grid()` (no waits) shows a receive several lines above its use.

**Directive programs**: Piper's JSON list (`print(program)`: one directive per line;
`Program.to_json`); fields left at their default (`stream`, `bucket_size`, ...) are not
written. Filters are `{tag: index}` maps; tags are the user's (`PP`, `EP`, ...) plus
`MB` (microbatch), `PASS` (F, B, BI, BW, U) and `SEG` (see below).

**The training DAG** (`dag.text()`, this module): one line per node, then one per edge,
node ids being the op and the tags, so a DAG diff reads like a schedule diff:

    N F[PP=0,MB=1] region=0 devices=0,2 stream=compute op=F tags=PP=0,MB=1,PASS=F attrs={}
    E F[PP=0,MB=1] -> F[PP=1,MB=1] values=h       (data: the values it carries)
    E F[PP=1,MB=0] ~> B[PP=1,MB=0] origin=4       (temporal: from directive #4)

Words: *stage* = a `PP` index; *region* = the part of the model one unique tag combination
selects (a stage holds one region, or several: a mixture-of-experts block is the router
side `{PP=0}`, one region per expert `{PP=0,EP=e}` and the part after the experts
`{PP=0,SEG=1}`); *SEG* numbers the later segments of a stage, the code that runs after
another tagged part inside it (the combine after the experts) or after another stage (a
module called twice); *PART* numbers the parts of a tensor-parallel region, between its
collectives (`{PP=0,PART=1}`: from the colwise layers to the rowwise ones); *device* = a
rank; *bucket* = a group of parameters synchronized by one collective. Costs in
`pn.CostModel.uniform(F=, B=, W=, FB=)` are the time of one pass of one region: F forward,
B full backward, W the weight half of a split backward (its input half I costs B - W), FB
an overlapped F&B slot (unset: F + B).

`instr_text` writes an instruction, `wait_text` a wait, `region_legend` / `bucket_legend`
the prefixes; the JSON form (`Plan.to_json`) is the exact exchange form of a plan, the text
is for reading. `TrainingDAG.text()` / `from_text` (and the JSON pair) round-trip a DAG.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from typing import Any

from piper_nb.errors import PlanError
from piper_nb.ir.filters import tags_text
from piper_nb.ir.kinds import LETTER, P2P, SHORT, EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node

__all__ = ["dag_lines", "parse_dag_lines", "dag_meta_json", "instr_text", "wait_text", "TP_LABEL",
           "region_legend", "bucket_legend"]

_FEEDS = re.compile(r"#b\d+\.(F|B|BI|BW)\d+$")     # a ZeRO-3 gather's node: the pass it feeds


def _mb(ins: Any) -> str:
    return str(ins.mb) if ins.mb >= 0 else ""


def instr_text(ins: Any) -> str:
    """One plan instruction (a `plan.instr.Instr`, or anything with its fields) in the
    notation above: `r0:F1`, `r0:SEND_F1>2`, `b0:RS1`, `b0:AG@F1`, `r0:DISPATCH_F1`."""
    k = ins.kind
    scope = f"r{ins.region}:" if ins.region >= 0 else ""
    if k in LETTER:
        return f"{scope}{LETTER[k]}{_mb(ins)}"
    if k == Op.U:
        return f"{scope}U"
    if k in P2P:
        arrow = ">" if k == Op.SEND else "<"
        return f"{scope}{k}_{'B' if ins.data.grad else 'F'}{_mb(ins)}{arrow}{ins.data.peer}"
    if k == Op.ALL_TO_ALL and ins.purpose in (Purpose.DISPATCH, Purpose.COMBINE):
        return f"{scope}{ins.purpose.upper()}_{'B' if ins.data.grad else 'F'}{_mb(ins)}"
    if k in SHORT and ins.purpose in (Purpose.TP, Purpose.CP):   # between parts; R:
        phase = "R" if ins.data.regather else "B" if ins.data.grad else "F"   # gathered again
        return f"{scope}{SHORT[k]}_{phase}{_mb(ins)}"
    if k in SHORT and ins.purpose in (Purpose.NORM, Purpose.COUNT):   # clipping's norm, the
        return f"{ins.purpose}:{SHORT[k]}"                            # global loss's count
    if k in SHORT:
        if ins.data.bucket < 0:                  # not over a bucket (hand-written plans)
            return f"{scope}{SHORT[k]}" + (f"@{ins.mb}" if ins.mb >= 0 else "")
        feeds = _FEEDS.search(ins.node or "")
        if feeds:
            return f"b{ins.data.bucket}:{SHORT[k]}@{LETTER[Op(feeds.group(1))]}{_mb(ins)}"
        return f"b{ins.data.bucket}:{SHORT[k]}{_mb(ins)}"
    if k == Op.FREE:
        return "free(" + ",".join(ins.data.keys) + ")"
    return k


TP_LABEL = re.compile(r"r\d+:(?:AR|RS|AG)_[FBR]\d*$")   # r1:AR_F0: a tensor-parallel collective


def wait_text(target: Any) -> str:
    """The WAIT that completes the issued instruction `target`: `wait(r0:RECV_B0<1)`."""
    return f"wait({instr_text(target)})"


def region_legend(regions, width: int = 96) -> str:
    """`r0 = {PP=0}   r1 = {PP=1,EP=0}`: what the `r` prefixes of a plan's text stand for
    (lines wrapped at `width`)."""
    lines, line = [], ""
    for r in regions:
        item = f"r{r.index} = {{{tags_text(r.tags)}}}"
        if line and len(line) + 3 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}   {item}" if line else item
    return "\n".join([*lines, line] if line else lines)


def bucket_legend(buckets) -> list[str]:
    """One line per bucket: `b0 = 12 parameters of r0, r3 over devices 0,1 (ZeRO-0)`."""
    out = []
    for b in buckets:
        n = len(b.params)
        out.append(f"b{b.index} = {n} parameter{'s' * (n != 1)} of "
                   f"{', '.join(f'r{r}' for r in b.regions)} over devices "
                   f"{','.join(map(str, b.group))} (ZeRO-{b.zero})")
    return out


def _tags_parse(text: str) -> tuple:
    out = []
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        out.append((k, int(v) if v.lstrip("-").isdigit() else v))
    return tuple(out)


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _unjson(v):
    if isinstance(v, list):
        return tuple(_unjson(x) for x in v)
    return v


def dag_lines(dag) -> str:
    """A DAG's text form (`TrainingDAG.text()`): its history, one line per node, one per edge."""
    lines = [f"# history: {' | '.join(dag.history)}"]
    for n in dag.nodes:
        attrs = json.dumps({k: _jsonable(v) for k, v in n.attrs}, separators=(",", ":"))
        lines.append(f"N {n.id} region={n.region} devices={','.join(map(str, n.devices))} "
                     f"stream={n.stream} op={n.op.value} tags={tags_text(n.tags, skip=())} attrs={attrs}")
    for e in dag.edges:
        arrow = "->" if e.kind == EdgeKind.DATA else "~>"
        extra = f" values={','.join(e.values)}" if e.values else ""
        extra += f" origin={e.origin}" if e.origin >= 0 else ""
        lines.append(f"E {e.src} {arrow} {e.dst}{extra}")
    return "\n".join(lines)


def parse_dag_lines(text: str) -> tuple[list[Node], list[Edge], tuple[str, ...]]:
    """(nodes, edges, history) of a DAG's text form (`TrainingDAG.from_text` builds the DAG)."""
    nodes, edges, history = [], [], ()
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            if line.startswith("# history:"):
                body = line.removeprefix("# history:").strip()
                history = tuple(body.split(" | ")) if body else ()
            elif line.startswith("N "):
                head, attrs = line[2:].split(" attrs=", 1)
                nid, *fields = head.split(" ")
                kv = dict(f.split("=", 1) for f in fields)
                nodes.append(Node(
                    id=nid, op=Op(kv["op"]), tags=_tags_parse(kv["tags"]), region=int(kv["region"]),
                    devices=tuple(int(d) for d in kv["devices"].split(",") if d),
                    stream=kv["stream"],
                    attrs=tuple((k, _unjson(v)) for k, v in json.loads(attrs).items())))
            elif line.startswith("E "):
                src, arrow, dst, *rest = line[2:].split(" ")
                kv = dict(f.split("=", 1) for f in rest)
                edges.append(Edge(src, dst, EdgeKind.DATA if arrow == "->" else EdgeKind.TEMPORAL,
                                  tuple(v for v in kv.get("values", "").split(",") if v),
                                  int(kv.get("origin", -1))))
        except (ValueError, KeyError) as err:
            raise PlanError(f"DAG text line {lineno} is malformed ({err}): {line!r}") from None
    return nodes, edges, history


def dag_meta_json(meta) -> dict:
    """A DAG's meta as JSON: dataclass tuples as objects, other values as they are or repr."""
    out = {}
    for k, v in meta:
        if isinstance(v, tuple) and v and is_dataclass(v[0]):
            out[k] = [asdict(x) for x in v]
        else:
            try:
                json.dumps(v)
                out[k] = v
            except TypeError:
                out[k] = repr(v)
    return out
