"""An older spelling of the distillation loss: the module a team had before it adopted the seed API.

    loss_fn = KDLoss(temperature=2.0, ignore_index=-100, fp32_upcast=True, chunk_size=0)
    loss = loss_fn(student_logits, teacher_logits, labels, num_valid_tokens=None, process_group=None)

It computes what the seed's `KDLoss` computes (T² · forward KL over the full vocab, summed over the
valid tokens and divided by `num_valid_tokens`, or averaged when that is None), but is spelled
differently:
- the constructor takes `temperature` before `ignore_index` and has no `tp_group`;
- the tensor-parallel group is passed per call, as `process_group`, and the logits are then this
  rank's vocab shard as a plain tensor (DTensors are not understood);
- the global count of valid tokens is called `num_valid_tokens`.

Under `--impl kd_loss=...` as it is, it gets a `property:signature` finding (the seed's
`tp_group` is missing, `ignore_index` and `temperature` come in another order) and every call
with the seed's keywords fails. `kd_loss_adapter.py` maps it onto the seed API.

To keep the example short the per-token KL runs through shardcheck's own kernels; a real older
module has its own.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from shardcheck.distributed_impl.kd_loss import _kl_forward_chunked, _kl_forward_tp


class KDLoss(torch.nn.Module):
    """Forward KL(P_teacher ‖ P_student) · T² over the tokens whose label is not `ignore_index`."""

    def __init__(
        self, temperature: float = 1.0, ignore_index: int = -100, fp32_upcast: bool = True, chunk_size: int = 0
    ):
        super().__init__()
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.fp32_upcast = fp32_upcast
        self.chunk_size = chunk_size

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        labels: torch.Tensor,
        num_valid_tokens: Optional[Union[int, torch.Tensor]] = None,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> torch.Tensor:
        if student_logits.shape != teacher_logits.shape or labels.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"shapes do not match: student_logits {tuple(student_logits.shape)}, teacher_logits "
                f"{tuple(teacher_logits.shape)}, labels {tuple(labels.shape)}"
            )
        vocab = student_logits.shape[-1]
        valid = (labels != self.ignore_index).reshape(-1)
        student = student_logits.reshape(valid.numel(), vocab)[valid]
        teacher = teacher_logits.reshape(valid.numel(), vocab)[valid]
        if student.shape[0] == 0:
            # 0, still connected to the graph: backward gives zero gradients, no collective on any TP rank.
            dtype = torch.promote_types(student.dtype, torch.float32) if self.fp32_upcast else student.dtype
            return student.sum().to(dtype) + teacher.sum().to(dtype)
        if process_group is None:
            kl = _kl_forward_chunked(teacher, student, self.chunk_size, self.temperature, self.fp32_upcast)
        else:
            kl = _kl_forward_tp(teacher, student, process_group, self.chunk_size, self.temperature, self.fp32_upcast)
        denominator = num_valid_tokens if num_valid_tokens is not None else student.shape[0]
        return (kl * self.temperature**2).sum() / denominator
