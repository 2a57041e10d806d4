"""Bug: the per-token loss is the cross-entropy −Σ P log Q (teacher entropy not subtracted)."""

import importlib.util
from pathlib import Path

import torch

# A private copy of the real module whose log-ratio log P − log Q is replaced by −log Q
# (forward and the teacher-gradient formula both use it).
_spec = importlib.util.spec_from_file_location(
    "_kd_loss_cross_entropy", Path(__file__).resolve().parents[3] / "distributed_impl" / "kd_loss.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)
_m._safe_log_ratio = lambda p, log_p, log_q: torch.where(p > 0, -log_q, torch.zeros_like(log_q))

KDLoss = _m.KDLoss
_infer_tp_group_from_dtensor = _m._infer_tp_group_from_dtensor
