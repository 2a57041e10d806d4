"""BUG, two at once: the teacher's gradient is off at tp ≥ 2 (teacher_grad_off_at_tp.py) and the loss is not
multiplied by T² (as an upstream distillation loss was before its TP rewrite added the factor): loss and gradients
exactly 1/T² of the right ones at T != 1, on every path and mesh.  Both fail under the seed's rule as "wrong
values"; only the scale, a power of a case parameter, tells the two roots apart (tests/test_prefix_pair.py)."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/broken/kd_loss/
from teacher_grad_off_at_tp import TEACHER_GRAD_FACTOR, ScaleGrad  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        group = self.tp_group or good._infer_tp_group_from_dtensor(student_logits)
        if group is not None and dist.get_world_size(group) > 1:
            teacher_logits = ScaleGrad.apply(teacher_logits, TEACHER_GRAD_FACTOR)
        loss = super().forward(student_logits, teacher_logits, labels, num_batch_labels)
        return loss / self.temperature**2


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
