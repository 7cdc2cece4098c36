"""One table of constants per GPU for the analytic model (`HardwareSpec`, `HARDWARE`):
peaks, memory bandwidth and size, links, and the fractions of them kernels reach
(`sim.roofline`), each number with its source. No constant is fitted to a run the model
is checked against, and no benchmark passes one of its own (`tests/sim/test_gpus.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from piper_nb.errors import PlanError

__all__ = ["HardwareSpec", "HARDWARE", "spec_of"]


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator and its links: the constants of the per-operator model
    (`sim.roofline`) and of the links; rates in FLOP/s and bytes/s per direction, times in
    s. `sources` says where each number of a shipped GPU comes from."""

    name: str
    peak_flops: float           # dense bf16/fp16 FLOP/s of one device (tensor cores)
    fp32_flops: float = 0.0     # dense fp32 FLOP/s (no TF32, PyTorch's default for fp32
                                # matmuls); 0: peak_flops / 16, about the A100/H100 ratio
    fp8_flops: float = 0.0      # dense FP8 FLOP/s (tensor cores); 0: none (pn.float8 is refused)
    hbm_bandwidth: float        # bytes/s of device memory
    nvlink_bandwidth: float     # inside a node
    ib_bandwidth: float         # across nodes, per device
    node_size: int = 8          # devices per node
    nvlink_latency: float = 3.4e-6   # one hop (NCCL's Simple ring: `sim.topology`)
    ib_latency: float = 9.6e-6
    memory: float = math.inf    # bytes of device memory (HBM); a plan fits when its peak does
    matmul_efficiency: float = 0.8      # fraction of peak a large matmul reaches
    attention_efficiency: float = 0.35  # fraction of peak an attention kernel reaches
    hbm_efficiency: float = 0.85        # fraction of HBM bandwidth a large kernel streams at
    launch_overhead: float = 4e-6       # host time of one eager operator's launch
    sources: tuple = ()                 # (field, where its value comes from)

    def peak(self, precision: str = "bf16") -> float:
        """Dense FLOP/s for `precision` ("bf16"/"fp32"/"fp8", or a dtype's name: tensor cores
        for bfloat16, float16 and the float8 formats, the CUDA cores otherwise)."""
        if precision in ("bf16", "bfloat16", "float16", "fp16"):
            return self.peak_flops
        if precision == "fp8" or precision.startswith("float8"):
            if not self.fp8_flops:
                raise PlanError(f"{self.name} has no FP8 tensor cores, so the plan's Float8 "
                                "matmuls (pn.float8) cannot run there; drop pn.float8 from "
                                "the program, or plan for a GPU with them (H100, H200)")
            return self.fp8_flops
        return self.fp32_flops or self.peak_flops / 16

    def __post_init__(self):
        for f in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise PlanError(f"HardwareSpec {self.name}: {f} {getattr(self, f)} must be in "
                                "(0, 1]; it is the fraction of the peak a kernel reaches")
        if min(self.peak_flops, self.hbm_bandwidth, self.nvlink_bandwidth,
               self.ib_bandwidth, self.memory) <= 0 or self.node_size < 1 \
                or self.launch_overhead < 0 or self.fp8_flops < 0:
            raise PlanError(f"HardwareSpec {self.name}: rates and node_size must be positive")


_GiB = 2**30
_DATASHEET = {"A100": "NVIDIA A100 Tensor Core GPU datasheet (dense bf16 312 TFLOP/s, fp32 "
                      "19.5; 40 GB at 1,555 GB/s, 80 GB SXM at 2,039 GB/s; NVLink 600 GB/s "
                      "bidirectional)",
              "H100": "NVIDIA H100 Tensor Core GPU datasheet, SXM (dense bf16 989 TFLOP/s, "
                      "FP8 1,979, fp32 67; 80 GB at 3.35 TB/s; NVLink 900 GB/s "
                      "bidirectional)",
              "H200": "NVIDIA H200 Tensor Core GPU datasheet, SXM (dense bf16 989 TFLOP/s, "
                      "FP8 1,979, fp32 67; 141 GB at 4.8 TB/s; NVLink 900 GB/s "
                      "bidirectional)"}
_MATMUL = ("gpu_check.py on one H200 (2026-11): a 8192^3 bf16 matmul at 788 TFLOP/s, 0.80 "
           "of the dense peak (benchmarks/RESULTS.md); the A100's and H100's cuBLAS are taken "
           "to reach the same fraction, and fp32 and FP8 matmuls too (none measured yet)")
_FA2_H = ("FlashAttention-3 (Shah et al. 2024, sec. 1): FlashAttention-2, the kernel behind "
          "PyTorch's flash attention, reaches about 35% of the H100's peak")
_FA2_A = ("FlashAttention-2 (Dao 2023, sec. 4): 50-73% of the A100's peak forward, less "
          "backward: 0.5")
_HBM = ("an assumption, not yet measured here: a large streaming kernel reaches about 85% of "
        "the HBM peak; gpu_check.py is where its measurement goes")
_LAUNCH = ("PyTorch's 'Accelerating PyTorch with CUDA Graphs' (2021): an eager operator "
           "costs the host a few microseconds to launch; 4 us")
_TITAN_PEAK = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: 'the actual peak "
               "TFLOPs number is between SXM and NVL, and we don't know its exact value' (HBM2e, "
               "500 W): the midpoint of the H100 SXM's and NVL's dense datasheet peaks, bf16 "
               "(989 + 835) / 2 = 912 TFLOP/s, FP8 (1,979 + 1,671) / 2 = 1,825, fp32 "
               "(67 + 60) / 2 = 63.5")
_HOP = ("NCCL's tuning model (src/graph/tuning.cc): one hop of its Simple ring, 3.4 us over "
        "NVLink and 9.6 us over the network")
_IB = ("one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100, H200) InfiniBand adapter per GPU, "
       "as in DGX systems: 25 and 50 GB/s")


def _spec(name: str, chip: str, attention: float, attention_source: str, **kw) -> HardwareSpec:
    peak = kw.pop("peak_source", _DATASHEET[chip])
    fp8 = ("the A100 has no FP8 tensor cores (its datasheet lists none): 0" if chip == "A100"
           else peak)
    sources = (("peak_flops", peak), ("fp32_flops", peak), ("fp8_flops", fp8),
               ("hbm_bandwidth", kw.pop("hbm_source", _DATASHEET[chip])),
               ("memory", kw.pop("memory_source", _DATASHEET[chip])),
               ("nvlink_bandwidth", _DATASHEET[chip] + ": half per direction"),
               ("ib_bandwidth", _IB), ("nvlink_latency", _HOP), ("ib_latency", _HOP),
               ("matmul_efficiency", _MATMUL),
               ("attention_efficiency", attention_source), ("hbm_efficiency", _HBM),
               ("launch_overhead", _LAUNCH))
    return HardwareSpec(name=name, attention_efficiency=attention, sources=sources, **kw)


HARDWARE = {spec.name: spec for spec in (
    _spec("A100", "A100", 0.5, _FA2_A, peak_flops=312e12, fp32_flops=19.5e12,
          hbm_bandwidth=2.039e12, nvlink_bandwidth=300e9, ib_bandwidth=25e9,
          memory=80 * _GiB),
    _spec("A100-40GB", "A100", 0.5, _FA2_A, peak_flops=312e12, fp32_flops=19.5e12,
          hbm_bandwidth=1.555e12, nvlink_bandwidth=300e9, ib_bandwidth=25e9,
          memory=40 * _GiB),
    _spec("H100", "H100", 0.35, _FA2_H, peak_flops=989e12, fp32_flops=67e12, fp8_flops=1979e12,
          hbm_bandwidth=3.35e12, nvlink_bandwidth=450e9, ib_bandwidth=50e9,
          memory=80 * _GiB),
    # the H100s torchtitan's Llama 3.1 runs used (Grand Teton): 96 GB of HBM2e at 2.4 TB/s,
    # a 500 W power limit, peaks between the SXM's and the NVL's (torchtitan's words)
    _spec("H100-96GB", "H100", 0.35, _FA2_H, peak_flops=912e12, fp32_flops=63.5e12,
          fp8_flops=1825e12, hbm_bandwidth=2.4e12, nvlink_bandwidth=450e9, ib_bandwidth=50e9,
          memory=96 * _GiB, peak_source=_TITAN_PEAK,
          hbm_source="torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e "
                     "at 2.4 TB/s per GPU, 500 W",
          memory_source="torchtitan, benchmarks/llama3_h100_202412_torchtitan.md"),
    _spec("H200", "H200", 0.35, _FA2_H, peak_flops=989e12, fp32_flops=67e12, fp8_flops=1979e12,
          hbm_bandwidth=4.8e12, nvlink_bandwidth=450e9, ib_bandwidth=50e9,
          memory=141 * _GiB),
)}


def spec_of(hardware) -> HardwareSpec:
    """`hardware` as a spec: a name in HARDWARE, or a `HardwareSpec` as it is."""
    if isinstance(hardware, HardwareSpec):
        return hardware
    if hardware not in HARDWARE:
        raise PlanError(f"unknown hardware {hardware!r}; use one of {', '.join(HARDWARE)} "
                        "or a HardwareSpec(...)")
    return HARDWARE[hardware]
