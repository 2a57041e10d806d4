"""Bug: the KL is multiplied by T instead of T²."""

from distributed_impl.kd_loss import KDLoss as _KDLoss, _infer_tp_group_from_dtensor  # noqa: F401


class KDLoss(_KDLoss):
    def forward(self, student_logits, teacher_logits, labels, num_batch_labels=None):
        return super().forward(student_logits, teacher_logits, labels, num_batch_labels) / self.temperature
