"""Bug: without num_batch_labels the mean is taken over all tokens, ignored ones included."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        if num_batch_labels is None:
            num_batch_labels = labels.numel()
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
