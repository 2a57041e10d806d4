"""An independently written KDLoss that does what the seed says of fp32_upcast ("Cast logits to float32 before
computing softmax / log-softmax"), float64 logits included: its float64 loss is only as good as float32 and comes
back in float32.  That is the seed's documented precision, so shardcheck reports nothing, even under --strict."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def _compute_dtype(student_dtype: torch.dtype, teacher_dtype: torch.dtype, fp32_upcast: bool) -> torch.dtype:
    return torch.float32 if fp32_upcast else torch.promote_types(student_dtype, teacher_dtype)


export_real_module(globals(), "kd_loss", _compute_dtype=_compute_dtype)
