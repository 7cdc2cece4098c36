"""`pn.train` runs a compiled plan on workers; `pn.reference_train` is the plain baseline.

Both split every batch into the same microbatches and scale each microbatch's loss by
1/microbatches (the plan's `loss_scale` also divides by the data-parallel width), so a
correct plan reproduces the reference's losses and parameters to fp32 rounding: the check
nanoGPT-style codebases use for every parallel strategy. Both return a `Result`.
"""

from piper_nb.train.loop import train
from piper_nb.train.reference import reference_train
from piper_nb.train.result import Result

__all__ = ["Result", "train", "reference_train"]
