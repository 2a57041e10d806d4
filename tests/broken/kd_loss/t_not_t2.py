"""Bug: the KL is multiplied by T instead of T²."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels) / self.temperature


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
