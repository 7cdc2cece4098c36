"""Float8 linear layers as torchao's float8 training runs them with tensorwise dynamic
scaling (`float8_linear`), and the capture rewrite that puts them in a region's graph
(`float8_linears`).

A Float8 linear casts its input and weight to float8 e4m3 with one scale each (the
format's largest value over the tensor's absolute maximum, an amax reduction), multiplies
them with `torch._scaled_mm` into the input's dtype and adds the bias; the backward casts
the output's gradient to e5m2 and runs two more scaled matmuls, the input's gradient (with
the weight cast again) and the weight's (with the input cast again). Like torchao it saves
the input and the weight in their own precision and casts again in the backward.

The backward computes only the gradients the running backward asks for (a split backward's
BI the input's, BW the weight's): it asks the autograd engine whether each one's edge will
run (`torch._C._will_engine_execute_node`), through a view of each so that a leaf asks
too.

`torch._scaled_mm` runs on CUDA GPUs of compute capability 8.9 and later (L40S, H100,
H200) and on the CPU; on CUDA both dimensions of the weight must be multiples of 16, so
only such linears are rewritten (torchao's rule).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

__all__ = ["float8_linear", "float8_linears", "eligible", "uses_float8", "check_training",
           "Float8Linear", "Float8Matmul", "E4M3", "E5M2"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12
_LINEAR = torch.ops.aten.linear.default
PREFIX = "float8_matmul_"


def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in float8 `dtype`, the scale that turns it back): tensorwise dynamic scaling."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().max().float()
    scale = top / torch.clamp(amax, min=_EPS)
    # row-major whatever t's layout (element-wise ops keep a transposed input's strides):
    # what `_scaled_mm` takes as its first operand on CUDA
    return (t.float() * scale).clamp(-top, top).to(dtype).contiguous(), scale.reciprocal()


def _col(t: torch.Tensor) -> torch.Tensor:
    """`t` laid out column-major (what `_scaled_mm` takes as its second operand on CUDA)."""
    return t.t().contiguous().t()


def _mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
        dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dtype)


def _needed(t: torch.Tensor):
    return get_gradient_edge(t).node if t.requires_grad else None


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x8, sx = _cast(x, E4M3)
    w8, sw = _cast(w, E4M3)
    return _mm(x8, sx, w8.t(), sw, x.dtype)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.nodes = (_needed(x), _needed(w))
        ctx.save_for_backward(x, w)
        return _forward(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        need = [n is not None and torch._C._will_engine_execute_node(n) for n in ctx.nodes]
        g8, sg = _cast(grad, E5M2)
        gx = gw = None
        if need[0]:
            w8, sw = _cast(w, E4M3)
            gx = _mm(g8, sg, _col(w8), sw, x.dtype)
        if need[1]:
            x8, sx = _cast(x, E4M3)
            gw = _mm(g8.t().contiguous(), sg, _col(x8), sx, w.dtype)
        return gx, gw


def float8_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with Float8 matmuls (see the module docstring)."""
    flat = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled():
        out = _Float8Matmul.apply(flat.view_as(flat), weight.view_as(weight))
    else:   # no graph to build (a recomputed forward's first run, an evaluation)
        out = _forward(flat, weight)
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


class Float8Matmul(nn.Module):
    """`float8_linear` as a submodule of a region's graph (a call of it stays one node when
    the graph is traced again, as unpickling a GraphModule does); it holds no parameters."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return float8_linear(x, weight, bias)


class Float8Linear(nn.Linear):
    """An `nn.Linear` that multiplies in Float8 (`float8_linear`): the eager model a Float8
    plan trains like, for `pn.reference_train` (`Float8Linear.swap`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias)

    @classmethod
    def swap(cls, model: nn.Module, prefixes=("",)) -> nn.Module:
        """A copy of `model` whose eligible `nn.Linear` layers under any of the module paths
        `prefixes` ("": all) are Float8Linear, sharing nothing with `model`."""
        import copy
        model = copy.deepcopy(model)
        for name, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and eligible(mod.weight) and any(
                    name == p or name.startswith(p + ".") or not p for p in prefixes):
                mod.__class__ = cls
        return model


def eligible(weight: torch.Tensor) -> bool:
    """Whether a linear of this weight may run in Float8 (both dimensions multiples of 16)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _linear(gm: fx.GraphModule, n: fx.Node):
    """(x, weight node or path, bias node or path, weight) of a linear layer call, or None."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if type(mod) is nn.Linear and len(n.args) == 1 and not n.kwargs:
            path = str(n.target)
            return n.args[0], f"{path}.weight", f"{path}.bias" if mod.bias is not None \
                else None, mod.weight
        return None
    if n.op != "call_function" or n.target not in (F.linear, _LINEAR):
        return None
    args = list(n.args) + [n.kwargs.get("bias")] * (3 - len(n.args))
    w, b = args[1], args[2]
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return None
    return args[0], w, b, gm.get_parameter(str(w.target))


def float8_linears(gm: fx.GraphModule) -> int:
    """Every eligible linear layer of `gm` (an `nn.Linear` call, or `F.linear` /
    `aten.linear` on a parameter) made a call of a `Float8Matmul` submodule, in place; how
    many."""
    done = 0
    g = gm.graph
    for n in list(g.nodes):
        found = _linear(gm, n)
        if found is None or not eligible(found[3]):
            continue
        x, w, b, _ = found
        name = f"{PREFIX}{done}"
        while hasattr(gm, name):
            name += "_"
        gm.add_module(name, Float8Matmul())
        with g.inserting_before(n):
            w = g.get_attr(w) if isinstance(w, str) else w
            b = g.get_attr(b) if isinstance(b, str) else b
            new = g.call_module(name, (x, w, b) if b is not None else (x, w))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def uses_float8(modules) -> bool:
    """Whether any of these captured regions runs a Float8 linear."""
    return any(isinstance(sub, Float8Matmul) for m in modules for sub in m.modules())


def check_training(modules, tp_groups=None, device=None) -> None:
    """Refuse, before anything runs, to train Float8 regions where it would not run or not
    train like one process: on a CUDA device without FP8 matmuls (compute capability under
    8.9), or under tensor parallelism (a shard's scale is its own amax, not the whole
    tensor's, so the shards would not compute what one process does)."""
    from piper_nb.errors import PlanError
    if not uses_float8(modules):
        return
    if tp_groups:
        raise PlanError("pn.float8 with tensor_parallel trains with each shard scaled by its own "
                        "amax, not the whole weight's, so it would not train like one process; "
                        "the plan prices and simulates as it is (pn.simulate, "
                        "CostModel.analytic), but to train it drop pn.float8 or tensor_parallel",
                        op="float8")
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 9):
            raise PlanError(f"pn.float8 needs FP8 matmuls, which {torch.cuda.get_device_name(dev)}"
                            f" (compute capability {cap[0]}.{cap[1]}) lacks: they start at 8.9 "
                            "(L40S, H100, H200); drop pn.float8 to train here", op="float8")
