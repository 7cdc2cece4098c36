"""The memory ledger: one device's instruction list walked the way the worker runs it
(`runtime.worker`, `runtime.stores`), over sizes instead of tensors.

`Ledger` keeps the bytes device `d` holds, by kind (`ir.kinds.Memory`), in running totals
so a sample costs O(1). Its step loop dispatches each instruction by kind, as the worker's
does, to a handler of the same name: `_forward`, `_backward` and `_update` (the worker's
`run`), `_issue`, `_wait` and `_free`; a WAIT's completion then calls the ledger's
counterpart of the store method the worker calls (`_set_grads`, `_add_grad_shard`,
`_acquire`, `_write_params` and `_release`, in `sim.ledger_params`; `_exchange_done`).
The rule it follows, kind by kind, is `sim.memory`'s (its docstring);
`sim.memory.memory_samples` drives it.
"""

from __future__ import annotations

from piper_nb.ir.kinds import BACKWARDS, BUCKET_COLLECTIVES, COMM, PASSES, Held, Op, Purpose, Unit
from piper_nb.ir.loss_outputs import LOSS, is_loss_output
from piper_nb.plan.instr import parse_free, slice_name
from piper_nb.plan.sizes import NORM_BYTES, element_size, value_bytes
from piper_nb.sim.ledger_params import (
    ACTIVATIONS,
    BUFFERS,
    GRADS,
    OPTIM,
    PARAMS,
    ParamLedger,
    param_numel,
)
from piper_nb.sim.memory_settings import MemorySettings
from piper_nb.sim.tokens import Routing
from piper_nb.sim.update_state import state_levels, update_states
from piper_nb.trace import MemorySample

# how the step loop dispatches an instruction: kind -> handler (the worker's names)
_HANDLERS = {Op.F: "_forward", **dict.fromkeys(BACKWARDS, "_backward"), Op.U: "_update",
             **dict.fromkeys(COMM, "_issue"), Op.WAIT: "_wait", Op.FREE: "_free"}


class _Buf:
    """One allocated value buffer: counted while at least one holder keeps it."""

    __slots__ = ("nbytes", "holders")

    def __init__(self, nbytes: int):
        self.nbytes, self.holders = nbytes, 0


class _Stash:
    __slots__ = ("saved", "leaves", "refs", "out_grads", "inputs")

    def __init__(self, saved: int, leaves: list[str], refs: list[_Buf], inputs: dict | None):
        self.saved, self.leaves, self.refs, self.out_grads = saved, leaves, refs, []
        self.inputs = inputs   # a recomputed forward's input buffers, until its backward


class Ledger(ParamLedger):
    """Bytes held on device `d`, instruction by instruction: the worker's bookkeeping
    (`runtime.worker`, `runtime.stores`) over sizes instead of tensors, with running totals
    so a sample costs O(1)."""

    def __init__(self, plan, d: int, settings: MemorySettings, routing: Routing):
        self.plan, self.instrs, self.d = plan, plan.devices[d].instrs, d
        self.frozen = frozenset(plan.frozen)
        self.vbytes = {k: value_bytes(v) for k, v in plan.values.items()}
        self.routing = routing
        self.pb, self.gb = settings.param_bytes, settings.grad_bytes
        # gradients travel (and ZeRO shards of them are kept) in the plan's reduction dtype
        self.rb = element_size(plan.reduce_dtype) if plan.reduce_dtype else self.gb
        regions = sorted({i.region for i in self.instrs if i.kind in PASSES
                          and 0 <= i.region < len(plan.regions)})
        names = dict.fromkeys(p for r in regions for p in plan.regions[r].params)
        names.update(dict.fromkeys(p for i in self.instrs if i.kind == Op.U for p in i.data.params))
        self.names = {n: None for n in names if n in plan.params}
        self.gsize = {n: param_numel(plan, n) * (self.gb if self.gb is not None else self.elem(n))
                      for n in self.names}
        self.buckets = {b.index: b for b in plan.buckets
                        if d in b.group and any(n in names for n in b.params)}
        ustate = update_states(plan, self.instrs, d, self.buckets, settings)
        start, after = state_levels(list(ustate.values()), settings.first_step)
        self.optim_after = dict(zip(ustate, after, strict=True))   # U index -> state held
        # running totals: params, grads, optim, activations, buffers
        self.level = [self._params_held(), 0, start, 0, 0]
        self.grads: dict[str, None] = {}          # parameters with a gradient (ordered set)
        self.grad_shards: dict[int, float] = {}   # bucket -> reduced shard bytes
        self.refs: dict[int, int] = {}            # ZeRO-3 bucket -> gathers in use
        self.pending: dict[int, tuple[int, float]] = {}   # issue index -> (kind, bytes)
        self.zero_shards: dict[int, float] = {}   # ZeRO-1/2 updated shards before the gather
        self.acts: dict[tuple[str, int], _Buf] = {}
        self.vgrads: dict[tuple[str, int], _Buf] = {}
        self.stash: dict[tuple[int, int], _Stash] = {}
        self.aliases = {r: dict(pairs) for r, pairs in plan.aliases.items()}   # out -> in
        # decoded once, as the worker does: each instruction's handler (None: nothing held)
        self.handlers = self._handlers()

    def _handlers(self) -> list:
        """Each instruction's handler, looked up once (None: nothing to count)."""
        by_kind = {kind: getattr(self, name) for kind, name in _HANDLERS.items()}
        n_regions = len(self.plan.regions)
        return [None if ins.kind in PASSES and not 0 <= ins.region < n_regions  # no tables
                else by_kind.get(ins.kind) for ins in self.instrs]

    # -- sizes --
    def _vb(self, v: str, mb: int, expert: bool = False) -> int:
        """Bytes of value v's buffer for microbatch mb; routed rows per `self.routing`
        (`expert`: made inside an expert, on its owner, so with the group's rows)."""
        if v in self.plan.rows:
            return self.routing.value_bytes(v, mb, self.d, expert)
        return self.vbytes.get(v, 0)

    # -- holders of value buffers (runtime.stores.ValueStore) --
    def _hold(self, buf: _Buf) -> None:
        buf.holders += 1
        if buf.holders == 1:
            self.level[ACTIVATIONS] += buf.nbytes

    def _let_go(self, buf: _Buf | None) -> None:
        if buf is not None:
            buf.holders -= 1
            self.level[ACTIVATIONS] -= buf.nbytes if buf.holders == 0 else 0

    def _put(self, table: dict, key: tuple[str, int], buf: _Buf) -> None:
        self._hold(buf)
        self._let_go(table.get(key))
        table[key] = buf

    def _add_grad(self, v: str, mb: int, expert: bool = False) -> None:
        """A new gradient buffer (the sum with an earlier one is a new tensor too)."""
        self._put(self.vgrads, (v, mb), _Buf(self._vb(v, mb, expert)))

    def _leaves(self, region: int, mb: int) -> list[str]:
        """The inputs a forward detaches into autograd leaves: floats that need a gradient."""
        out = []
        for v in self.plan.regions[region].inputs:
            info = self.plan.values.get(v)
            if v not in self.plan.batch_names and (v, mb) in self.acts and (
                    info is None or (info.dtype.startswith(("float", "bfloat"))
                                     and info.requires_grad)):
                out.append(v)
        return out

    def _drop_stash(self, key: tuple[int, int]) -> None:
        st = self.stash.pop(key)
        self.level[ACTIVATIONS] -= st.saved
        for buf in st.refs:
            self._let_go(buf)
        for buf in st.out_grads:
            self._let_go(buf)

    # -- compute (the worker's `run`) --
    def _forward(self, i: int, ins) -> None:
        """F: the outputs' buffers (an alias: its input's), and a stash holding what autograd
        saved (input and output buffers among it counted as those values: `plan.kept`)
        until the last backward, inputs kept as sequence slices as those; a recomputed
        forward's stash holds its inputs instead, a unit's first run (`Unit.FIRST`) none; a
        second run stores what it keeps."""
        again, expert, unit = ins.data.recompute, ins.region in self.routing.experts, ins.data.unit
        kept_in, kept_out = self.plan.kept.get(ins.region, ((), ()))
        held = self.plan.regions[ins.region].inputs if again else kept_in
        inputs = {v: self.acts[(v, ins.mb)] for v in held
                  if (v, ins.mb) in self.acts and v not in ins.data.slices}
        for v in ins.data.slices:   # kept as this device's slice instead
            self._put(self.acts, (slice_name(v), ins.mb), _Buf(self._vb(slice_name(v), ins.mb)))
        refs = list(inputs.values())
        same = self.aliases.get(ins.region, {})   # an output that is its input's buffer
        for v in self.plan.regions[ins.region].outputs:
            buf = self.acts.get((same.get(v), ins.mb)) or _Buf(self._vb(v, ins.mb, expert))
            refs += [buf] if v in kept_out and not again else []
            if not is_loss_output(v) and (unit != Unit.AGAIN or v in ins.data.keep):
                self._put(self.acts, (v, ins.mb), buf)
        if unit == Unit.FIRST:
            return
        for buf in refs:
            self._hold(buf)
        saved = 0 if again else self.routing.saved(ins.region, ins.mb, self.d)
        self.level[ACTIVATIONS] += saved
        key = (ins.region, ins.mb)
        if key in self.stash:
            self._drop_stash(key)
        self.stash[key] = _Stash(saved, self._leaves(ins.region, ins.mb), refs,
                                 inputs if again else None)

    def _out_grads(self, ins) -> list[_Buf]:
        """The output gradients a BI keeps until its BW (and a fresh loss gradient), held."""
        outs = self.plan.regions[ins.region].outputs
        grads = [self.vgrads[(v, ins.mb)] for v in outs
                 if not is_loss_output(v) and (v, ins.mb) in self.vgrads]
        if LOSS in outs:
            grads.append(_Buf(self.vbytes.get(LOSS, 0)))
        for buf in grads:
            self._hold(buf)
        return grads

    def _backward(self, i: int, ins) -> None:
        """B, BI or BW: B and BW make parameter gradients and drop the stash; B and BI make
        the input gradients; BI keeps the output gradients for its BW."""
        key = (ins.region, ins.mb)
        st = self.stash.get(key)
        if st is None:
            return
        if ins.kind != Op.BI:
            self._param_grads(self.plan.regions[ins.region].params)
            self._drop_stash(key)
        else:
            if ins.data.recompute:
                self._recomputed(ins, st)
            st.out_grads = self._out_grads(ins)
        if ins.kind != Op.BW:
            for v in st.leaves:
                self._add_grad(v, ins.mb, ins.region in self.routing.experts)

    def _recomputed(self, ins, st: _Stash) -> None:
        """A recomputed region's BI ran its forward again: the stash now holds what autograd
        saved, the input buffers among it and new output buffers (a B drops it at once)."""
        expert = ins.region in self.routing.experts
        kept_in, kept_out = self.plan.kept.get(ins.region, ((), ()))
        refs = [st.inputs[v] for v in kept_in if v in st.inputs]
        refs += [_Buf(self._vb(v, ins.mb, expert)) for v in kept_out]
        for buf in refs:
            self._hold(buf)
        for buf in st.refs:
            self._let_go(buf)
        st.refs, st.inputs = refs, None
        st.saved = self.routing.saved(ins.region, ins.mb, self.d)
        self.level[ACTIVATIONS] += st.saved

    def _update(self, i: int, ins) -> None:
        """U (`ParamStore.update`): gradients consumed, updated ZeRO-1/2 shards held until
        their gather, the optimizer state of what it updates exists from here on."""
        self._drop_grads(ins.data.params)
        for b in ins.data.buckets:
            if b in self.buckets and self.buckets[b].zero != 3 and b not in self.zero_shards:
                self.zero_shards[b] = self._shard(b, self.pb)
                self.level[BUFFERS] += self.zero_shards[b]
            self.level[GRADS] -= self.grad_shards.pop(b, 0)
        self.level[OPTIM] = self.optim_after[i]

    # -- communication --
    def _issue(self, i: int, ins) -> None:
        """An issued transfer holds its buffers from issue to WAIT (a SEND's values are
        already counted); a reduce-scatter takes the gradients at issue."""
        k, b = ins.kind, ins.bucket
        if ins.is_scalar:   # clipping's squared-norm share, the global loss's count
            self.pending[i] = (BUFFERS, NORM_BYTES)
            self.level[BUFFERS] += NORM_BYTES
            return
        if ins.sums_values:   # one flat copy of the values it sums, and under
            nbytes = sum(self._vb(v, ins.mb) for v in ins.data.values)   # SP a member's slices
            if k != Op.ALL_REDUCE:
                nbytes += sum(self._vb(v, ins.mb) // len(ins.data.group) for v in ins.data.values)
            self.pending[i] = (BUFFERS, nbytes)
            self.level[BUFFERS] += nbytes
            return
        if k == Op.SEND or (k in BUCKET_COLLECTIVES and b not in self.buckets):
            return
        if k == Op.RECV:
            kind, nbytes = ACTIVATIONS, sum(self._vb(v, ins.mb) for v in ins.data.values)
        elif k == Op.ALL_REDUCE:
            kind, nbytes = BUFFERS, self._padded(b, self.rb)
        elif k == Op.REDUCE_SCATTER:  # a flat copy of the gradients and the output shard
            kind, nbytes = BUFFERS, self._padded(b, self.rb) + self._shard(b, self.rb)
            self._drop_grads(self.buckets[b].params)
        elif k == Op.ALL_GATHER:      # a gathered ZeRO-3 bucket counts as parameters
            kind = PARAMS if self.buckets[b].zero == 3 else BUFFERS
            nbytes = self._padded(b, self.pb)
        else:                         # ALL_TO_ALL: what it sends and what it gets
            kind, nbytes = BUFFERS, self._exchanged(ins)
        self.pending[i] = (kind, nbytes)
        self.level[kind] += nbytes

    def _wait(self, i: int, ins) -> None:
        """WAIT: the transfer's buffers go, what it delivered is held."""
        kind, nbytes = self.pending.pop(ins.data.target, (0, 0))
        self.level[kind] -= nbytes
        src = self.instrs[ins.data.target]
        k, b = src.kind, src.bucket
        if src.is_regather:   # an input kept as slices, whole again
            for v in src.data.values:
                self._put(self.acts, (v, src.mb), _Buf(self._vb(v, src.mb)))
        if k in BUCKET_COLLECTIVES and b not in self.buckets:
            return
        if k == Op.RECV:
            for v in src.data.values:
                if src.data.grad:
                    self._add_grad(v, src.mb)
                else:
                    self._put(self.acts, (v, src.mb), _Buf(self._vb(v, src.mb)))
        elif k == Op.ALL_REDUCE:
            self._set_grads(b)
        elif k == Op.REDUCE_SCATTER:
            self._add_grad_shard(b)
        elif k == Op.ALL_GATHER:
            if self.buckets[b].zero == 3:
                self._acquire(b)
            else:
                self._write_params(b)
        elif k == Op.ALL_TO_ALL:
            self._exchange_done(src)

    def _free(self, i: int, ins) -> None:
        """FREE: a gathered bucket's use ends (`param:b`), or a value buffer is let go."""
        for key in ins.data.keys:
            kind, what = parse_free(key)
            if kind == Held.PARAM:
                self._release(what)
            else:
                table = self.acts if kind == Held.ACT else self.vgrads
                self._let_go(table.pop(what, None))

    # -- the token exchange (runtime.exchange) --
    def _exchanged(self, ins) -> int:
        """Bytes an ALL_TO_ALL has in flight here: what this member sends plus what it gets
        (a dispatch sends own rows to each owner, which gets the group's; a combine the
        reverse)."""
        return sum(self._vb(v, ins.mb) + (self._vb(v, ins.mb, expert=True) if owner == self.d
                                          else 0)
                   for v, owner in zip(ins.data.values, ins.data.owners, strict=True))

    def _exchange_done(self, ins) -> None:
        """An exchange's WAIT: what was sent is let go, what came is held (acts or grads)."""
        table = self.vgrads if ins.data.grad else self.acts
        dispatch = ins.purpose == Purpose.DISPATCH
        for v, owner in zip(ins.data.values, ins.data.owners, strict=True):
            key, mine = (v, ins.mb), owner == self.d
            if dispatch or mine:
                self._let_go(table.pop(key, None))
            if mine or not dispatch:   # the owner gets the group's rows, each member its own
                self._put(table, key, _Buf(self._vb(v, ins.mb, expert=dispatch)))

    # -- the step loop --
    def run(self, times: list[float], device: int, extra: float = 0.0) -> list[MemorySample]:
        """One sample per instruction, after it ran (`extra`: allowances added to buffers)."""
        out = []
        level = self.level
        for i, (ins, handler) in enumerate(zip(self.instrs, self.handlers, strict=True)):
            if handler is not None:
                handler(i, ins)
            out.append(MemorySample(device, times[i], int(level[0]), int(level[1]),
                                    int(level[2]), int(level[3]), int(level[4] + extra)))
        return out
