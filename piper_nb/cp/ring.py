"""The point-to-point ring in a region's graph (`pn.context_parallel(..., rotate="p2p")`):
each attention made `degree` steps of ring attention (`capture.ring_steps`), one part
each, with the keys and values the ring delivers between them.

For an attention whose queries, keys and values are made in part `L`:

- step 0 (the device's own keys and values) runs in part `L + 1`, so that the first
  exchange, which sends what part `L` made, runs beside it;
- step `j` runs in part `L + 1 + j`, on the keys and values `ring_shift` marks: values no
  part makes (*delivered* values), which each device receives from the member before it
  in the ring while step `j - 1` runs, and sends on to the member after it while step `j`
  runs; the last step's part goes on with the rest of the region (`ring_out`, the output
  projection, ...).

`steps` rewrites one attention; `levels` gives every op its part (`tp.build_parts` then
cuts the graph, delivered values becoming inputs of the parts that read them and outputs
of none). The exchanges themselves are the plan's SEND and RECV instructions (`cp.ring_dag`):
the delivered value's name on the receiving device, the one it came from on the sending
device (`CPLayout.rotations`), and their gradients back the other way.
"""

from __future__ import annotations

import torch.fx as fx

from piper_nb.capture.ring_steps import STATE_EXTRA, ring_out, ring_shift, ring_step

__all__ = ["steps", "levels"]


def steps(g: fx.Graph, att, degree: int, rank: fx.Node, balance: str, causal: bool,
          full: dict, ghosts: dict, firsts: set) -> fx.Node:
    """The attention `att` as `degree` ring steps (inserted before its output) -> the node
    of its output. Records each delivered value's node in `ghosts` (-> the step it
    follows) and each first step in `firsts`; `full` gets the steps' whole-sequence
    shapes (the state's: the output's with `STATE_EXTRA` more columns)."""
    whole = full.get(att.out.name)
    k, v, state = att.k, att.v, None
    for j in range(degree):
        if j:
            k, v = g.call_function(ring_shift, (k,)), g.call_function(ring_shift, (v,))
            ghosts[k] = ghosts[v] = state
        state = g.call_function(ring_step, (att.q, k, v, state, j, degree, rank, balance,
                                            causal, att.scale, att.gqa))
        if whole is not None:
            full[state.name] = (*whole[:-1], whole[-1] + STATE_EXTRA)
        if not j:
            firsts.add(state)
    out = g.call_function(ring_out, (state,))
    full[out.name] = whole
    return out


def levels(gm: fx.GraphModule, pads: set, ghosts: dict, firsts: set) -> dict:
    """Each op's part: a reader of a padded value one part after it (the all-gather
    between, `cp.rewrite`); under the ring (see the module docstring) a delivered value
    one part after the step it follows, a first step one part after what it reads; ops
    on constants only float to the earliest part that reads them."""
    level, floating = {}, []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            level[n] = 0
            continue
        if n in ghosts:
            level[n] = level[ghosts[n]] + 1
            continue
        ins = [a for a in n.all_input_nodes if a in level]
        if not ins:
            floating.append(n)
            continue
        level[n] = max(level[a] + (a in pads) for a in ins) + (n in firsts)
    for n in reversed(floating):
        level[n] = min((level[u] for u in n.users if u in level), default=0)
    return level
