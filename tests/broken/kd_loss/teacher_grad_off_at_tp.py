"""BUG: at tp ≥ 2 the teacher's gradient is 1.5 times the right one (a wrong term, not a mesh size: the student's
gradient and the loss stay right).  The fixed copy of a pair (tests/test_prefix_pair.py) whose pre-fix copy,
student_grad_reduced_twice.py, also multiplies the student's gradient by the TP size."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

TEACHER_GRAD_FACTOR = 1.5


class ScaleGrad(torch.autograd.Function):
    """The identity, its gradient times `k`."""

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
        if group is not None and dist.get_world_size(group) > 1:
            teacher_logits = ScaleGrad.apply(teacher_logits, TEACHER_GRAD_FACTOR)
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
