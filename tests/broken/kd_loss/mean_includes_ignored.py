"""Bug: without num_batch_labels the mean is taken over all tokens, ignored ones included."""

from distributed_impl.kd_loss import KDLoss as _KDLoss, _infer_tp_group_from_dtensor  # noqa: F401


class KDLoss(_KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        if num_batch_labels is None:
            num_batch_labels = labels.numel()
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels)
