"""Bug: with chunk_size > 0 the last partial chunk of valid tokens is dropped (still counted in the mean)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        valid = labels != self.ignore_index
        n = int(valid.sum())
        rest = n % self.chunk_size if self.chunk_size > 0 else 0
        if rest:  # the last `rest` valid tokens never reach the loss; the denominator still counts them
            num_batch_labels = n if num_batch_labels is None else num_batch_labels
            labels = labels.clone()
            labels.view(-1)[valid.view(-1).nonzero().view(-1)[-rest:]] = self.ignore_index
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
