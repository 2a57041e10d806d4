"""Three bugs on purpose, each under its own condition, like an older upstream-style distillation loss
(tests/test_causes.py expects three findings, one per bug):
- everywhere: the per-token loss is the cross-entropy −Σ P log Q (the teacher entropy not subtracted);
- at tp ≥ 2: the student gradient is multiplied by the TP size;
- at dp ≥ 2, where a DP rank holds no valid token: that rank returns a plain 0 with no autograd graph, so it
  raises in backward and its DP peer blocks."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _safe_log_ratio(p, log_p, log_q):
    return torch.where(p > 0, -log_q, torch.zeros_like(log_q))


# The copy's KDLoss computes with the replaced helper; the class below adds the other two bugs on top of it.
export_real_module(globals(), "kd_loss", _safe_log_ratio=_safe_log_ratio)
_CrossEntropyKDLoss = globals()["KDLoss"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class KDLoss(_CrossEntropyKDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        local = labels.to_local() if hasattr(labels, "to_local") else labels
        if not (local != self.ignore_index).any():
            dtype = torch.promote_types(student_logits.dtype, torch.float32) if self.fp32_upcast else student_logits.dtype
            return torch.zeros((), dtype=dtype, device=local.device)  # the right value, but no graph
        group = self.tp_group or good._infer_tp_group_from_dtensor(student_logits)
        if group is not None and dist.get_world_size(group) > 1:
            student_logits = _ScaleGrad.apply(student_logits, dist.get_world_size(group))
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)

