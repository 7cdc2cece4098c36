"""Small example models shipped for notebooks and tests: MLP, TinyGPT, Llama, TinyMoE,
MegatronGPT (the GPT layer activation-memory papers count), and StageGraph (stages
forming a DAG: skips, ties, frozen layers, buffers, shared modules).

Each has `example_batch(batch_size, seed)`, a traceable `loss_fn(output, targets)` that is a
plain mean (so microbatching preserves gradients), a `config` dict and seeded init. The
top-level children (`layers`, or `embed`/`blocks`/`head`) are the natural annotation points.
"""

from .gpt import TinyGPT
from .graph import GraphSpec, StageGraph
from .llama import Llama
from .megatron import MegatronGPT, MegatronLayer
from .mlp import MLP
from .moe import TinyMoE

__all__ = ["MLP", "TinyGPT", "Llama", "TinyMoE", "MegatronGPT", "MegatronLayer", "StageGraph",
           "GraphSpec"]
