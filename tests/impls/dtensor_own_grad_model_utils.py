"""Correct, the other convention: the DTensor front ends gather their per-token result over CP as the seed does,
`DTensor.from_local(x, cp_mesh, [Shard(1)]).full_tensor()`, whose backward keeps each CP rank's own upstream gradient
at its positions (ours sums every CP rank's).  The seed fixes neither, so both pass (issue 42, item 4); the row
records `grad_convention` "own"."""

import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402

from shardcheck.distributed_impl import model_utils as good  # noqa: E402


def _full_tensor_over_cp(local, cp_group, positions):
    """The full sequence in natural order through DTensor's all-gather: rank r's piece holds positions[r]."""
    if positions.shape[0] == 1:
        return local
    mesh = DeviceMesh.from_group(cp_group, local.device.type)
    gathered = DTensor.from_local(local, mesh, [Shard(1)]).full_tensor()  # rank-major order
    return gathered[:, torch.argsort(positions.reshape(-1)).to(local.device)]


def _next_token_logprobs(
    logits, target, positions, cp_group, cp_rank, start, end, tp_group, inference_only, chunk_size, sampling_params
):
    good._check_logits("vocab_parallel_logits", logits)
    seq_len = positions.numel()
    good._check_target("target", target, logits.shape[0], seq_len)
    local_target = good._shift_pad_and_take(target, seq_len, positions, cp_rank)
    logprobs = good._vocab_parallel_logprobs(
        logits, local_target, start, end, tp_group, inference_only, chunk_size, sampling_params
    )
    return _full_tensor_over_cp(logprobs, cp_group, positions)[:, : target.shape[1] - 1].contiguous()


def dtensor_from_parallel_logits_to_logprobs(
    vocab_parallel_logits,
    target,
    vocab_start_index,
    vocab_end_index,
    tp_group,
    inference_only=False,
    seq_index=None,
    chunk_size=None,
    sampling_params=None,
):
    cp_group, cp_size = good._seq_shard_group(target)
    positions = good._cp_layout(seq_index, vocab_parallel_logits.shape[1] * cp_size, cp_size)
    ids = good._full_ids(target, positions, cp_group)
    return _next_token_logprobs(
        vocab_parallel_logits,
        ids,
        positions,
        cp_group,
        good._cp_size_rank(cp_group)[1],
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        chunk_size,
        sampling_params,
    )


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits, input_ids, seq_index=None, chunk_size=None, sampling_params=None
):
    local, tp_group, start, end = good._dtensor_vocab_shard(vocab_parallel_logits)
    cp_group, cp_size = good._seq_shard_group(vocab_parallel_logits)
    positions = good._cp_layout(seq_index, vocab_parallel_logits.shape[1], cp_size)
    ids = good._full_ids(input_ids, positions, cp_group)
    return _next_token_logprobs(
        local,
        ids,
        positions,
        cp_group,
        good._cp_size_rank(cp_group)[1],
        start,
        end,
        tp_group,
        not torch.is_grad_enabled(),
        chunk_size,
        sampling_params,
    )


export_real_module(
    globals(),
    "model_utils",
    dtensor_from_parallel_logits_to_logprobs=dtensor_from_parallel_logits_to_logprobs,
    get_logprobs_from_vocab_parallel_logits=get_logprobs_from_vocab_parallel_logits,
)
