"""Bug: on the TP path the gradients are multiplied by the TP size (the loss values stay correct)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        group = self.tp_group or good._infer_tp_group_from_dtensor(student_logits)
        if group is not None:
            k = dist.get_world_size(group)
            student_logits, teacher_logits = _ScaleGrad.apply(student_logits, k), _ScaleGrad.apply(teacher_logits, k)
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
