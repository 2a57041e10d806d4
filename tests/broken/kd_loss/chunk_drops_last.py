"""Bug: with chunk_size > 0 the last partial chunk of valid tokens is dropped (still counted in the mean)."""

from distributed_impl.kd_loss import KDLoss as _KDLoss, _infer_tp_group_from_dtensor  # noqa: F401


class KDLoss(_KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        valid = labels != self.ignore_index
        n = int(valid.sum())
        rest = n % self.chunk_size if self.chunk_size > 0 else 0
        if rest:  # the last `rest` valid tokens never reach the loss; the denominator still counts them
            num_batch_labels = n if num_batch_labels is None else num_batch_labels
            labels = labels.clone()
            labels.view(-1)[valid.view(-1).nonzero().view(-1)[-rest:]] = self.ignore_index
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)
