"""BUG, two at once: the teacher's gradient is off at tp ≥ 2 (teacher_grad_off_at_tp.py) and the student's
gradient is multiplied by the TP size (the per-token loss all-reduced by an autograd collective whose backward reduces
the gradient again, as an upstream distillation loss did before its fix).  Both fail in the same items, at tp ≥ 2,
under the seed's rule: only the scale tells the two roots apart (tests/test_prefix_pair.py)."""

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
            student_logits = ScaleGrad.apply(student_logits, dist.get_world_size(group))
            teacher_logits = ScaleGrad.apply(teacher_logits, TEACHER_GRAD_FACTOR)
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
