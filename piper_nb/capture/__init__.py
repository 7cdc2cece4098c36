"""Capture: annotations on an nn.Module, tracing, and splitting into regions."""

from piper_nb.capture.annotate import Spec, annotate, cut_stages, pipeline_units
from piper_nb.capture.experts import expert_slices
from piper_nb.capture.region import region
from piper_nb.capture.split import LOSS, Capture, RegionInfo, capture_regions, run_reference

__all__ = ["Spec", "annotate", "cut_stages", "pipeline_units", "expert_slices", "region",
           "Capture", "RegionInfo", "capture_regions", "run_reference", "LOSS"]
