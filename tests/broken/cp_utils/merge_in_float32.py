"""Bug: the ring attention computes and merges its blocks in float32 whatever the input dtype (as
torch 2.13's own CP attention does): float64 comes back with ~1e-7 error."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32


export_real_module(globals(), "cp_utils", _compute_dtype=_compute_dtype)
