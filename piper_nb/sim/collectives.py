"""Collectives priced as NCCL runs them over a `Topology` (`collective_time`).

NCCL prices each (algorithm, protocol) with a latency and a bus bandwidth and runs the
fastest (its tuning model, src/graph/tuning.cc); so does this module:

- **Bus bandwidth** (nccl-tests' PERFORMANCE.md: algbw = bytes / time, busbw = algbw x
  2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all). A group
  inside one node streams at NVLink x nvlink_efficiency. A group spanning nodes is a ring
  whose channels cross the network through each member's own adapter (rail-optimized
  nodes): min(NVLink, members per node x adapter) at each link's efficiency. This is the
  hierarchy: 8 GPUs of a node in one group share 8 adapters, one GPU per node has its own.
- **Ring** (every collective): 2(n-1) steps for all-reduce, n-1 for the others, each step
  one hop, network hops where the ring crosses nodes (2(m-1) or m-1 of them over m
  nodes); time = latency + bytes x (steps / n) / busbw.
- **Tree** (all-reduce over two or more nodes; NCCL's double binary tree): a chain inside
  each node and a binary tree across nodes, latency 2((ppn-1) NVLink hops + log2(m)
  network hops), half the bus bandwidth per direction (algbw = 0.9 busbw / 2, at most 80
  GB/s of bus over more than two nodes): it wins for small buffers over many nodes.
- **Protocols**: Simple (full bandwidth, a latency of a few microseconds a hop), LL128
  (0.92 of it, 0.7 with one GPU per node) and LL (a quarter, 1/3.8 on trees; the least
  latency), with NCCL's per-hop and base latencies scaled to the topology's hop latency.
- **All-to-all** is grouped sends to every peer (as NCCL and PyTorch run it): each member
  sends bytes / n to each, over NVLink to its node's peers and its adapter to the others,
  both at once.
- **Point-to-point**: one hop, bytes / link bandwidth.

Not modelled: NVLink SHARP and CollNet (in-switch reductions), PAT (NCCL 2.23's
all-gather for one GPU per node), the tree's correction factors for medium sizes, and the
number of channels (NCCL's per-channel caps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from piper_nb.ir.kinds import Op
from piper_nb.sim.topology import Topology

__all__ = ["Algorithm", "Protocol", "Priced", "collective_time", "p2p_time", "bus_bandwidth"]


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"
    DIRECT = "direct"      # point-to-point and all-to-all


class Protocol(StrEnum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


# NCCL's tuning model (src/graph/tuning.cc): a collective's base latency and the latency of
# one hop (NVLink, network) per (algorithm, protocol), in microseconds. Hop latencies are
# scaled by the topology's over NCCL's Simple ring hop (3.4 us NVLink, 9.6 us network).
_BASE = {(Algorithm.TREE, Protocol.LL): 6.8, (Algorithm.TREE, Protocol.LL128): 14.0,
         (Algorithm.TREE, Protocol.SIMPLE): 0.0, (Algorithm.RING, Protocol.LL): 6.6,
         (Algorithm.RING, Protocol.LL128): 14.0, (Algorithm.RING, Protocol.SIMPLE): 8.4}
_HOP_NVLINK = {(Algorithm.TREE, Protocol.LL): .52, (Algorithm.TREE, Protocol.LL128): 1.25,
               (Algorithm.TREE, Protocol.SIMPLE): 28.0, (Algorithm.RING, Protocol.LL): .47,
               (Algorithm.RING, Protocol.LL128): 1.9, (Algorithm.RING, Protocol.SIMPLE): 3.4}
_HOP_NET = {(Algorithm.TREE, Protocol.LL): 5.0, (Algorithm.TREE, Protocol.LL128): 8.5,
            (Algorithm.TREE, Protocol.SIMPLE): 50.0, (Algorithm.RING, Protocol.LL): 2.7,
            (Algorithm.RING, Protocol.LL128): 4.0, (Algorithm.RING, Protocol.SIMPLE): 9.6}
_SIMPLE_RING = (Algorithm.RING, Protocol.SIMPLE)
_LAUNCH = _BASE[_SIMPLE_RING] * 1e-6   # what the simplest collective or message costs, in s
_TREE_MAX_BUS = 80e9           # NCCL's cap on a tree's bus bandwidth over more than 2 nodes
_RING_PLATEAU = 1.9            # NCCL: a multi-node Simple ring all-reduce's large-size latency


@dataclass(frozen=True)
class Priced:
    """One collective's predicted time and how NCCL would run it."""

    seconds: float
    algorithm: Algorithm
    protocol: Protocol
    bus_bandwidth: float       # bytes/s, nccl-tests' busbw of this run


def bus_bandwidth(topo: Topology, members) -> float:
    """The Simple protocol's bus bandwidth of a group (bytes/s per GPU): NVLink inside a
    node; across nodes the least of NVLink and the adapters of a node's members."""
    nodes, local = topo.spread(members)
    if nodes <= 1:
        return topo.nvlink_rate
    return min(topo.nvlink_rate, local * topo.network_rate)


def _steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == Op.ALL_REDUCE else n - 1


def _hops(topo: Topology, algo: Algorithm, proto: Protocol, nodes: int) -> tuple[float, float]:
    """(NVLink hop, network hop) latencies in s of one algorithm and protocol."""
    intra = _HOP_NVLINK[(algo, proto)] / _HOP_NVLINK[_SIMPLE_RING] * topo.nvlink_latency
    inter = _HOP_NET[(algo, proto)] / _HOP_NET[_SIMPLE_RING] * topo.network_latency
    if nodes > 1 and proto == Protocol.LL:
        intra *= 1.8                       # NCCL: LL's NVLink hops slow beside the network
    return intra, inter


def _ring(kind, n, nodes, local, nbytes, topo, proto, bus) -> float:
    steps, inter_steps = _steps(kind, n), _steps(kind, nodes) if nodes > 1 else 0
    intra, inter = _hops(topo, Algorithm.RING, proto, nodes)
    lat = _BASE[(Algorithm.RING, proto)] * 1e-6 + (steps - inter_steps) * intra \
        + inter_steps * inter
    if proto == Protocol.LL:
        bus *= 0.25 if nodes > 1 or kind == Op.ALL_REDUCE else 1 / 3
    elif proto == Protocol.LL128:
        bus *= 0.7 if local < 2 and nodes > 1 else 0.92
    if proto == Protocol.SIMPLE and nodes > 1 and kind == Op.ALL_REDUCE \
            and nbytes >= n / 16 * 65536:
        lat *= _RING_PLATEAU
    return lat + nbytes * steps / n / bus


def _tree(n, nodes, nbytes, topo, proto, bus) -> float:
    intra, inter = _hops(topo, Algorithm.TREE, proto, nodes)
    ppn = n // nodes
    lat = _BASE[(Algorithm.TREE, proto)] * 1e-6 + 2 * ((ppn - 1) * intra
                                                       + math.log2(nodes) * inter)
    bus = min(bus * 0.9, _TREE_MAX_BUS if nodes > 2 else math.inf)
    if proto == Protocol.LL:
        bus /= 3.8
    elif proto == Protocol.LL128:
        bus *= 0.915
    return lat + nbytes / (0.5 * bus)


def collective_time(kind: str, members, nbytes: float, topo: Topology) -> Priced:
    """The time of one collective of `kind` whose full buffer is `nbytes` (the reduced
    buffer; the gathered one) over the devices `members`, as NCCL would run it: the
    fastest algorithm and protocol (see the module docstring)."""
    n = len(members)
    if n < 2:   # NCCL returns at once: what is left is the launch
        return Priced(_LAUNCH, Algorithm.RING, Protocol.SIMPLE, math.inf)
    nodes, local = topo.spread(members)
    bus = bus_bandwidth(topo, members)
    if kind == Op.ALL_TO_ALL:
        return _all_to_all(n, nodes, local, nbytes, topo)
    best = None
    for proto in Protocol:
        options = [(Algorithm.RING, _ring(kind, n, nodes, local, nbytes, topo, proto, bus))]
        if kind == Op.ALL_REDUCE and nodes > 1:
            options.append((Algorithm.TREE, _tree(n, nodes, nbytes, topo, proto, bus)))
        for algo, t in options:
            if best is None or t < best[0]:
                best = (t, algo, proto)
    t, algo, proto = best
    factor = _steps(kind, n) / n
    return Priced(t, algo, proto, nbytes * factor / t if t > 0 else math.inf)


def _all_to_all(n, nodes, local, nbytes, topo) -> Priced:
    """Grouped sends: bytes / n to each peer, NVLink and the adapter at once."""
    share = nbytes / n
    intra_bytes = (local - 1) * share
    inter_bytes = (n - local) * share
    move = max(intra_bytes / topo.nvlink_rate, inter_bytes / topo.network_rate)
    hop = topo.network_latency if nodes > 1 else topo.nvlink_latency
    t = _LAUNCH + hop + move
    return Priced(t, Algorithm.DIRECT, Protocol.SIMPLE, nbytes * (n - 1) / n / t)


def p2p_time(a: int, b: int, nbytes: float, topo: Topology) -> float:
    """One message from device a to device b: a hop of NVLink or network, and its bytes."""
    if topo.node(a) == topo.node(b):
        lat, bw = topo.nvlink_latency, topo.nvlink_rate
    else:
        lat, bw = topo.network_latency, topo.network_rate
    return _LAUNCH + lat + nbytes / bw
