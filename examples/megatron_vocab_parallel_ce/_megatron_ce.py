"""Megatron-Core's vocab-parallel cross-entropy with its tensor-parallel group passed explicitly: the module under
test of the megatron_vocab_parallel_ce example suite.

`megatron.core.tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0)`
reads its TP group, rank and size from `megatron.core.parallel_state`, which a Megatron training job fills with
`initialize_model_parallel`.  A test has no Megatron job: this wrapper sets only that group for the duration of
the forward call and restores what was there (the backward communicates nothing).  Megatron-Core is imported on
the first call, so the module imports without it (its suite then records every case `skip`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def tensor_parallel_group(group: dist.ProcessGroup) -> Iterator[None]:
    """`parallel_state`'s TP group is `group` inside the block, whatever it was before (usually unset)."""
    from megatron.core import parallel_state

    saved = parallel_state._TENSOR_MODEL_PARALLEL_GROUP
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group
    try:
        yield
    finally:
        parallel_state._TENSOR_MODEL_PARALLEL_GROUP = saved


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Megatron's op, unchanged: the per-token loss [*] of this rank's vocab shard [*, V/TP] of the logits and the
    token ids [*].  `tp_group`: the TP group to use; None keeps the one `parallel_state` already holds."""
    from megatron.core import tensor_parallel

    if tp_group is None:
        return tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)
    with tensor_parallel_group(tp_group):
        return tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)
