"""Bug: a rank that holds no valid token returns a plain 0 with no autograd graph (the seed's loss stays
connected: zero gradients).  That rank raises in backward; its DP peer then blocks in the next collective."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        local = labels.to_local() if hasattr(labels, "to_local") else labels
        if not (local != self.ignore_index).any():
            dtype = torch.promote_types(student_logits.dtype, torch.float32) if self.fp32_upcast else student_logits.dtype
            return torch.zeros((), dtype=dtype, device=local.device)  # the right value, but no graph
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
