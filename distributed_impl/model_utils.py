"""Sharded implementations of ``nemo_rl.distributed.model_utils`` (semantics: docs/ops/model_utils.md).

Vocab is sharded contiguously over the TP group: rank r owns global ids
``[vocab_start_index, vocab_end_index)``. Softmax-family math runs in the compute dtype
``promote_types(dtype, float32)``; outputs stay in it and input gradients come back in the
input's dtype. Outputs of a TP all-reduce are replicated, so their backward is the identity:
each rank returns the gradient of its own shard and no gradient is all-reduced again.
Ids outside ``[0, V)`` (e.g. -100) give 0 and a zero gradient.

Context parallelism: sequence-sharded inputs are [B, S/CP, ...] in the load-balanced head-tail
layout (see "context parallelism" below) unless a ``seq_index`` permutation says otherwise;
per-token results are all-gathered over CP, so every CP rank returns the full sequence, and each
CP rank's result is a separate summand for the backward.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import _linear_ce_fusion


@dataclass
class TrainingSamplingParams:
    """Local stand-in for ``nemo_rl.algorithms.logits_sampling_utils.TrainingSamplingParams``.

    Any object with ``top_k``, ``top_p`` and ``temperature`` attributes is accepted.
    """

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


# ----------------------------------------------------------------------------- helpers


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _upcast(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """x in its compute dtype (float32 at least), divided by ``temperature`` after the upcast."""
    x = x.to(_compute_dtype(x.dtype))
    return x / temperature if temperature != 1.0 else x


def _check_logits(name: str, x: torch.Tensor, ndim: int = 3) -> None:
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_integer(name: str, ids: torch.Tensor) -> None:
    if torch.is_floating_point(ids) or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")


def _check_ids(name: str, ids: torch.Tensor, shape: tuple) -> None:
    _check_integer(name, ids)
    if tuple(ids.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(ids.shape)}")


def _check_vocab_range(V_local: int, vocab_start_index: int, vocab_end_index: int) -> None:
    if vocab_start_index < 0 or vocab_end_index - vocab_start_index != V_local:
        raise ValueError(
            f"vocab range [{vocab_start_index}, {vocab_end_index}) does not match the local vocab size {V_local}"
        )


def _check_chunk_size(chunk_size: Any) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _chunks(S: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s0, min(S, s0 + chunk_size)) for s0 in range(0, S, chunk_size)]


def _check_saved(ctx: Any) -> None:
    if ctx.inference_only:
        raise RuntimeError("backward called on an op run with inference_only=True (nothing was saved)")


def _gather_owned(
    values: torch.Tensor,
    ids: torch.Tensor,
    vocab_start_index: int,
    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda v, i: v.gather(-1, i),
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather(values, id - start) (values[..., id - start]) for the ids this rank owns, 0 elsewhere; plus
    the owned mask."""
    V_local = values.shape[-1]
    owned = (ids >= vocab_start_index) & (ids < vocab_start_index + V_local)
    if V_local == 0:  # an empty shard (torch.chunk of a tiny vocab) owns nothing
        # zeros that stay in the autograd graph (a sum over the empty vocab), so this rank's backward
        # runs like its peers' and hands back its empty gradient instead of raising
        return values.sum(-1, keepdim=True).expand(ids.shape).contiguous(), owned
    picked = gather(values, torch.where(owned, ids - vocab_start_index, 0))
    return torch.where(owned, picked, torch.zeros((), dtype=picked.dtype)), owned


def _sum_with_owner_count(
    picked: torch.Tensor, owned: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce SUM of the per-rank picks, together with whether any rank owns each id.

    The owner count rides in the same all-reduce; no owner means the id is outside [0, V),
    which must give a zero gradient (a rank cannot tell that from its own range alone).
    """
    packed = torch.stack([picked, owned.to(picked.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return packed[0], packed[1] > 0


def _gather_logprob_grad(
    softmax: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, grad_output: torch.Tensor, vocab_start_index: int
) -> torch.Tensor:
    """Local-shard gradient of sum_k g_k * logp[ids_k]: g_k added at each owned id, minus softmax * sum_k g_k.

    The one-hot part is built first and the total summed from it (plus the ids other ranks own), as the
    autograd of log_softmax and gather does: where the softmax is exactly 1 (V = 1, a one-hot row) and the
    ids repeat, the two cancel exactly to the true 0 instead of leaving a rounding residue of sum_k g_k.
    """
    g = torch.where(valid, grad_output.to(softmax.dtype), torch.zeros((), dtype=softmax.dtype))
    V_local = softmax.shape[-1]
    owned = (ids >= vocab_start_index) & (ids < vocab_start_index + V_local)
    grad = torch.zeros_like(softmax)
    if V_local > 0:
        grad.scatter_add_(-1, torch.where(owned, ids - vocab_start_index, 0), torch.where(owned, g, 0.0))
    total = grad.sum(-1, keepdim=True) + torch.where(owned, 0.0, g).sum(-1, keepdim=True)
    return grad.addcmul_(softmax, total, value=-1)


def _check_same_across(group: dist.ProcessGroup, device: torch.device, what: str, **sizes: int) -> None:
    """All-to-all layouts need equal sizes on every rank: check with one small all-gather."""
    local = torch.tensor(list(sizes.values()), dtype=torch.int64, device=device)
    table = torch.empty(dist.get_world_size(group) * local.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, local, group=group)
    table = table.view(-1, local.numel())
    if (table != table[0]).any():
        per_rank = ", ".join(f"{name}={table[:, i].tolist()}" for i, name in enumerate(sizes))
        raise ValueError(f"{what} needs equal sizes on every TP rank, got per rank: {per_rank}")


# ----------------------------------------------------------------------------- context parallelism
#
# The load-balanced ("head-tail") CP layout: a sequence of L positions is split into 2·CP equal
# chunks and CP rank r holds chunk r followed by chunk 2·CP−1−r (it balances causal attention).
# Every CP op below describes a layout by `positions`: a [CP, L/CP] table whose row r lists the
# global sequence positions CP rank r holds, in its local order (head-tail, head-tail per packed
# sequence, or an explicit permutation `seq_index`).  Per-token results are all-gathered over CP
# through that table; each CP rank's use of the gathered tensor is a separate summand of the loss,
# so the backward sums the upstream gradients over CP and keeps this rank's positions.


def _cp_size_rank(cp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if cp_group is None:
        return 1, 0
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _head_tail_positions(length: int, cp_size: int) -> torch.Tensor:
    """[CP, L/CP] head-tail table: row r = chunks r and 2·CP−1−r of 2·CP (any L without CP)."""
    if cp_size == 1:
        return torch.arange(length).view(1, length)
    if length % (2 * cp_size):
        raise ValueError(
            f"sequence length {length} is not divisible by 2·CP = {2 * cp_size} (CP = {cp_size}): pad it first"
        )
    chunks = torch.arange(length).view(2 * cp_size, length // (2 * cp_size))
    return torch.cat([chunks[:cp_size], chunks[cp_size:].flip(0)], dim=1)


def _packed_head_tail_positions(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[CP, T/CP] table of the head-tail layout applied to each packed sequence on its own."""
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens_padded must start at 0 and be non-decreasing, got {bounds}")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"packed sequence [{start}, {end}) has padded length {end - start}, "
                f"not divisible by 2·CP = {2 * cp_size}"
            )
        pieces.append(start + _head_tail_positions(end - start, cp_size))
    return torch.cat(pieces, dim=1)


def _permutation_positions(seq_index: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[CP, L/CP] table of an explicit layout: rank r holds seq_index[r·L/CP : (r+1)·L/CP]."""
    order = seq_index.detach().long().cpu().reshape(-1)
    L = order.numel()
    if L % cp_size or not torch.equal(order.sort().values, torch.arange(L)):
        raise ValueError(f"seq_index must be a permutation of the {L} positions, divisible by CP = {cp_size}")
    return order.view(cp_size, L // cp_size)


def _gather_positions(
    local: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, positions: torch.Tensor
) -> torch.Tensor:
    """Every rank's local piece along ``seq_dim`` put at its global positions: the full tensor."""
    cp_size = positions.shape[0]
    x = local.movedim(seq_dim, 0).contiguous()
    pieces = torch.empty((cp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(pieces, x, group=group)
    full = torch.empty_like(pieces)
    full[positions.reshape(-1).to(x.device)] = pieces
    return full.movedim(0, seq_dim)


def _sum_grads_at_positions(
    grad: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, positions: torch.Tensor
) -> torch.Tensor:
    """Backward of ``_gather_positions``: the sum over ranks of their upstream gradients, at this
    rank's positions (a reduce-scatter, done as all-to-all + local sum, which gloo supports).
    The incoming gradient may be expanded or non-contiguous and is never modified."""
    cp_size = positions.shape[0]
    g = grad.movedim(seq_dim, 0)
    send = g[positions.reshape(-1).to(g.device)].contiguous()  # row block r: rank r's positions
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    recv = recv.view(cp_size, send.shape[0] // cp_size, *send.shape[1:])
    total = recv.to(_compute_dtype(recv.dtype)).sum(0) if recv.is_floating_point() else recv.sum(0)
    return total.to(grad.dtype).movedim(0, seq_dim)


class _GatherCPPositions(torch.autograd.Function):
    """All-gather over CP through a positions table; each rank's output is a separate summand."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cp_group: dist.ProcessGroup, seq_dim: int, positions: torch.Tensor):
        ctx.cp_group, ctx.seq_dim, ctx.positions = cp_group, seq_dim, positions
        return _gather_positions(tensor, cp_group, seq_dim, positions)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _sum_grads_at_positions(grad, ctx.cp_group, ctx.seq_dim, ctx.positions), None, None, None


def _gather_cp(
    tensor: torch.Tensor, cp_group: Optional[dist.ProcessGroup], seq_dim: int, positions: torch.Tensor
) -> torch.Tensor:
    if positions.shape[0] == 1:
        return tensor
    return _GatherCPPositions.apply(tensor, cp_group, seq_dim % tensor.ndim, positions)


def _get_tokens_on_this_cp_rank(input_ids: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens in the head-tail layout: chunks ``cp_rank`` and ``2·cp_size−1−cp_rank``
    of 2·cp_size along ``seq_dim``, in that order.  Any dtype; ``cp_size == 1`` returns the input."""
    if cp_size == 1:
        return input_ids
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    L = input_ids.shape[seq_dim]
    if L % (2 * cp_size):
        raise ValueError(f"sequence length {L} is not divisible by 2·CP = {2 * cp_size} (CP = {cp_size}): pad it first")
    chunks = input_ids.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


class AllGatherCPTensor(torch.autograd.Function):
    """Inverse of the head-tail layout across the CP group: every rank gets the full sequence.

    Backward: each rank's use of the full tensor is a separate summand of the loss, so the
    gradient is the sum over CP ranks of their upstream gradients, restricted to this rank's
    two chunks.  The incoming gradient may be expanded or non-contiguous; it is not modified.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cp_group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
        cp_size = dist.get_world_size(cp_group)
        seq_dim %= tensor.ndim
        positions = _head_tail_positions(tensor.shape[seq_dim] * cp_size, cp_size)
        ctx.cp_group, ctx.seq_dim, ctx.positions = cp_group, seq_dim, positions
        return _gather_positions(tensor, cp_group, seq_dim, positions)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _sum_grads_at_positions(grad_outputs[0], ctx.cp_group, ctx.seq_dim, ctx.positions), None, None


def allgather_cp_sharded_tensor(tensor: torch.Tensor, cp_group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
    """Full sequence in natural order on every CP rank from head-tail pieces (``AllGatherCPTensor``)."""
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


def _check_target(name: str, target: torch.Tensor, batch: int, seq_len: int) -> None:
    """An unshifted [B, L] target with L ≤ the logits' full (possibly padded) sequence length."""
    _check_integer(name, target)
    if target.ndim != 2 or target.shape[0] != batch or not 2 <= target.shape[1] <= seq_len:
        raise ValueError(
            f"{name} must have shape [{batch}, L] with 2 ≤ L ≤ {seq_len} (the full sequence length of the logits), "
            f"got {tuple(target.shape)}"
        )


def _shift_pad_and_take(target: torch.Tensor, seq_len: int, positions: torch.Tensor, cp_rank: int) -> torch.Tensor:
    """This rank's next-token targets: position t scores token t+1 (the last position's wrapped-around
    id is dropped later), padded with 0 to ``seq_len``, at this rank's positions."""
    shifted = target.roll(shifts=-1, dims=-1)
    if shifted.shape[1] < seq_len:
        shifted = torch.nn.functional.pad(shifted, (0, seq_len - shifted.shape[1]), value=0)
    if positions.shape[0] == 1:
        return shifted
    return shifted[:, positions[cp_rank].to(shifted.device)]


# ----------------------------------------------------------------------------- distributed softmax


def _local_max(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] == 0:
        return x.new_full((*x.shape[:-1], 1), float("-inf"))
    return x.amax(dim=-1, keepdim=True)


@torch.no_grad()
def _compute_distributed_log_softmax(vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Stable log-softmax over the full (sharded) vocab, returned as the local shard, compute dtype."""
    x = _upcast(vocab_parallel_logits)
    logits_max = _local_max(x)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    x = x - logits_max
    sum_exp = x.exp().sum(-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return x.sub_(sum_exp.log_())


@torch.no_grad()
def _compute_distributed_softmax(vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Stable softmax over the full (sharded) vocab, returned as the local shard, compute dtype."""
    x = _upcast(vocab_parallel_logits)
    logits_max = _local_max(x)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    exp = (x - logits_max).exp_()
    sum_exp = exp.sum(-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return exp.div_(sum_exp)


# ----------------------------------------------------------------------------- log-probs


class DistributedLogprob(torch.autograd.Function):
    """[B,S] log-prob of ``target`` (already shifted) under the full-vocab softmax; replicated over TP."""

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        _check_logits("vocab_parallel_logits", vocab_parallel_logits)
        _check_ids("target", target, vocab_parallel_logits.shape[:2])
        _check_vocab_range(vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index)
        target = target.long()

        log_probs = _compute_distributed_log_softmax(vocab_parallel_logits, group)
        picked, owned = _gather_owned(log_probs, target.unsqueeze(-1), vocab_start_index)
        out, valid = _sum_with_owner_count(picked.squeeze(-1), owned.squeeze(-1), group)

        ctx.inference_only = inference_only
        if not inference_only:
            ctx.save_for_backward(log_probs.exp_(), target, valid)
            ctx.vocab_start_index = vocab_start_index
            ctx.input_dtype = vocab_parallel_logits.dtype
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        _check_saved(ctx)
        softmax, target, valid = ctx.saved_tensors
        grad = _gather_logprob_grad(
            softmax, target.unsqueeze(-1), valid.unsqueeze(-1), grad_outputs[0].unsqueeze(-1), ctx.vocab_start_index
        )
        return grad.to(ctx.input_dtype), None, None, None, None, None


def _chunked_logprob_forward(
    ctx: Any,
    logits: torch.Tensor,
    ids: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool,
    temperature: float,
) -> torch.Tensor:
    """[B,S,K] full-vocab log-probs of (logits / temperature) at global ``ids`` [B,S,K], chunk by chunk."""
    _check_logits("vocab_parallel_logits", logits)
    _check_vocab_range(logits.shape[-1], vocab_start_index, vocab_end_index)
    _check_chunk_size(chunk_size)
    ids = ids.long()

    picked = torch.zeros(ids.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
    owned = torch.zeros(ids.shape, dtype=torch.bool, device=logits.device)
    for s0, s1 in _chunks(logits.shape[1], chunk_size):
        # Upcast (and scale) one chunk at a time: the fp32 working set stays O(B*chunk*V_local).
        log_probs = _compute_distributed_log_softmax(_upcast(logits[:, s0:s1], temperature), tp_group)
        picked[:, s0:s1], owned[:, s0:s1] = _gather_owned(log_probs, ids[:, s0:s1], vocab_start_index)
    out, valid = _sum_with_owner_count(picked, owned, tp_group)

    ctx.inference_only = inference_only
    if not inference_only:
        ctx.save_for_backward(logits, ids, valid)
        ctx.vocab_start_index, ctx.chunk_size, ctx.tp_group = vocab_start_index, chunk_size, tp_group
        ctx.temperature = temperature
    return out


def _chunked_logprob_backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
    """Gradient of ``_chunked_logprob_forward`` w.r.t. the logits; grad_output is [B,S,K]."""
    _check_saved(ctx)
    logits, ids, valid = ctx.saved_tensors
    grad_input = torch.empty_like(logits)
    for s0, s1 in _chunks(logits.shape[1], ctx.chunk_size):
        # Recompute the softmax of this chunk instead of having saved O(B*S*V_local) of it.
        softmax = _compute_distributed_softmax(_upcast(logits[:, s0:s1], ctx.temperature), ctx.tp_group)
        grad = _gather_logprob_grad(
            softmax, ids[:, s0:s1], valid[:, s0:s1], grad_output[:, s0:s1], ctx.vocab_start_index
        )
        # d(z / T)/dz = 1 / T
        grad_input[:, s0:s1] = grad / ctx.temperature if ctx.temperature != 1.0 else grad
    return grad_input


class ChunkedDistributedLogprob(torch.autograd.Function):
    """Same values as DistributedLogprob, ``chunk_size`` sequence positions at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        _check_logits("vocab_parallel_logits", vocab_parallel_logits)
        _check_ids("target", target, vocab_parallel_logits.shape[:2])
        return _chunked_logprob_forward(
            ctx,
            vocab_parallel_logits,
            target.unsqueeze(-1),
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only,
            1.0,
        ).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _chunked_logprob_backward(ctx, grad_outputs[0].unsqueeze(-1)), None, None, None, None, None, None


class _ChunkedDistributedLogprobScaled(torch.autograd.Function):
    """ChunkedDistributedLogprob of ``logits / temperature``, scaling each chunk after its upcast
    (scaling the whole tensor first would either round in bf16 or materialise it in fp32)."""

    @staticmethod
    def forward(
        ctx, logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only, temperature
    ):
        _check_logits("vocab_parallel_logits", logits)
        _check_ids("target", target, logits.shape[:2])
        return _chunked_logprob_forward(
            ctx,
            logits,
            target.unsqueeze(-1),
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only,
            temperature,
        ).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _chunked_logprob_backward(ctx, grad_outputs[0].unsqueeze(-1)), None, None, None, None, None, None, None


class DistributedCrossEntropy(torch.autograd.Function):
    """[B,S] soft-target cross entropy H(p, q) = -sum_v p_v log q_v over the full vocab.

    p = softmax(target_logits), q = softmax(student_logits); terms with p_v = 0 count as 0.
    Gradient flows to the student only: (q - p) * g.
    """

    @staticmethod
    def forward(
        ctx: Any,
        student_logits: torch.Tensor,
        target_logits: torch.Tensor,
        group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        if student_logits.shape != target_logits.shape:
            raise ValueError(
                f"student_logits and target_logits must have the same shape, got "
                f"{tuple(student_logits.shape)} and {tuple(target_logits.shape)}"
            )
        _check_logits("student_logits", student_logits)
        _check_logits("target_logits", target_logits)

        p = _compute_distributed_softmax(target_logits, group)
        log_q = _compute_distributed_log_softmax(student_logits, group)
        terms = torch.where(p > 0, p * log_q, torch.zeros((), dtype=log_q.dtype))
        out = -terms.sum(-1)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)

        ctx.inference_only = inference_only
        if not inference_only:
            ctx.save_for_backward(p, log_q.exp_())
            ctx.input_dtype = student_logits.dtype
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        _check_saved(ctx)
        p, q = ctx.saved_tensors
        grad = (q - p) * grad_outputs[0].unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None


def _vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool,
    chunk_size: Optional[int],
    sampling_params: Any,
) -> torch.Tensor:
    """[B,S] log-probs of an already shifted target: picks the plain / chunked / sampling op
    (``tp_group=None``: the logits hold the full vocab, no communication)."""
    if tp_group is None:
        return _full_vocab_logprobs(logits, target, sampling_params)
    top_k, top_p, temperature = _sampling_tuple(sampling_params)
    filtering = _need_filtering(top_k, top_p)
    if chunk_size is None:
        # The unchunked ops upcast the whole tensor anyway, so scaling it first costs nothing extra.
        if temperature != 1.0:
            logits = _upcast(logits, temperature)
        if filtering:
            return DistributedLogprobWithSampling.apply(logits, target, tp_group, top_k, top_p, inference_only)
        return DistributedLogprob.apply(logits, target, vocab_start_index, vocab_end_index, tp_group, inference_only)
    # The chunked ops scale each chunk after its upcast.
    if filtering:
        return _ChunkedDistributedLogprobWithSamplingScaled.apply(
            logits, target, tp_group, top_k, top_p, chunk_size, inference_only, temperature
        )
    return _ChunkedDistributedLogprobScaled.apply(
        logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only, temperature
    )


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """[B,L-1] log-probs of the next token from vocab-parallel logits [B,S/CP,V_local] in the head-tail
    CP layout; ``target`` is the unshifted full [B,L] input ids (position t scores token t+1), L ≤ S:
    a target shorter than the (padded) sequence is padded with 0 and the padding stripped from the
    result.  The result is the full sequence on every CP and TP rank."""
    _check_logits("vocab_parallel_logits", vocab_parallel_logits)
    cp_size, cp_rank = _cp_size_rank(cp_group)
    B, S_local, _ = vocab_parallel_logits.shape
    positions = _head_tail_positions(S_local * cp_size, cp_size)
    return _next_token_logprobs(
        vocab_parallel_logits,
        target,
        positions,
        cp_group,
        cp_rank,
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        chunk_size,
        sampling_params,
    )


def _next_token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    positions: torch.Tensor,
    cp_group: Optional[dist.ProcessGroup],
    cp_rank: int,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool,
    chunk_size: Optional[int],
    sampling_params: Any,
) -> torch.Tensor:
    """Shared body of the next-token fronts: ``logits`` hold the sequence positions ``positions[cp_rank]``."""
    _check_logits("vocab_parallel_logits", logits)
    seq_len = positions.numel()
    _check_target("target", target, logits.shape[0], seq_len)
    local_target = _shift_pad_and_take(target, seq_len, positions, cp_rank)
    logprobs = _vocab_parallel_logprobs(
        logits, local_target, vocab_start_index, vocab_end_index, tp_group, inference_only, chunk_size, sampling_params
    )
    logprobs = _gather_cp(logprobs, cp_group, 1, positions)
    return logprobs[:, : target.shape[1] - 1].contiguous()


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
    target_is_pre_rolled: bool = False,
) -> torch.Tensor:
    """[B, unpacked_seqlen-1] next-token log-probs of packed sequences.

    Logits [1, T/CP, V_local]: sequence i occupies [cu_seqlens_padded[i], cu_seqlens_padded[i+1]) of
    the packed T positions (padded lengths divisible by 2·CP) and is laid out head-tail over CP on
    its own.  Each sequence is shifted inside its own segment.  ``target``: the unshifted packed ids
    [1, T], or with ``target_is_pre_rolled`` already shifted per sequence and CP-sharded [1, T/CP].
    Row i holds the first padded_len_i − 1 log-probs of sequence i, zeros after; compute dtype.
    """
    _check_logits("vocab_parallel_logits", vocab_parallel_logits)
    cp_size, cp_rank = _cp_size_rank(cp_group)
    if vocab_parallel_logits.shape[0] != 1:
        raise ValueError(f"packed logits must be [1, T/CP, V_local], got {tuple(vocab_parallel_logits.shape)}")
    if isinstance(unpacked_seqlen, bool) or not isinstance(unpacked_seqlen, int) or unpacked_seqlen < 2:
        raise ValueError(f"unpacked_seqlen must be an int ≥ 2, got {unpacked_seqlen!r}")
    T_local = vocab_parallel_logits.shape[1]
    positions = _packed_head_tail_positions(cu_seqlens_padded, cp_size)
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    if bounds[-1] != T_local * cp_size:
        raise ValueError(f"cu_seqlens_padded ends at {bounds[-1]}, but the logits hold {T_local}·{cp_size} positions")
    if target_is_pre_rolled:
        _check_ids("target", target, (1, T_local))
        local_target = target.long()
    else:
        _check_ids("target", target, (1, bounds[-1]))
        rolled = torch.cat([target[:, a:b].roll(shifts=-1, dims=1) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        local_target = rolled[:, positions[cp_rank].to(rolled.device)].long()
    logprobs = _vocab_parallel_logprobs(
        vocab_parallel_logits,
        local_target,
        vocab_start_index,
        vocab_end_index,
        group,
        inference_only,
        chunk_size,
        sampling_params,
    )
    logprobs = _gather_cp(logprobs, cp_group, 1, positions)[0]  # [T], natural order
    # Unpack: row i, column j is packed position start_i + j while j < padded_len_i − 1, else 0.
    starts = torch.tensor(bounds[:-1], device=logprobs.device)
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=logprobs.device)
    j = torch.arange(unpacked_seqlen - 1, device=logprobs.device)
    inside = j[None, :] < (lengths[:, None] - 1)
    index = torch.where(inside, starts[:, None] + j[None, :], 0)
    return torch.where(inside, logprobs[index], torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))


# ----------------------------------------------------------------------------- all-to-all layouts


def _vp2sq(x: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """[BS, V_local] -> [BS/TP, V]; sizes already checked."""
    world = dist.get_world_size(tp_group)
    BS, V_local = x.shape
    out = torch.empty(world * (BS // world) * V_local, dtype=x.dtype, device=x.device)
    # Row block w goes to rank w; rank w receives every rank's vocab slice of its rows.
    dist.all_to_all_single(out, x.contiguous().view(-1), group=tp_group)
    return out.view(world, BS // world, V_local).permute(1, 0, 2).reshape(BS // world, world * V_local)


def _sq2vp(y: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """[BS/TP, V] -> [BS, V_local]; exact inverse of ``_vp2sq``."""
    world = dist.get_world_size(tp_group)
    n, V = y.shape
    send = y.reshape(n, world, V // world).permute(1, 0, 2).contiguous().view(-1)
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=tp_group)
    return out.view(world * n, V // world)


class _VP2SQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return _vp2sq(x, tp_group)

    @staticmethod
    def backward(ctx, g):
        return _sq2vp(g, ctx.tp_group), None


class _SQ2VP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, tp_group):
        ctx.tp_group = tp_group
        return _sq2vp(y, tp_group)

    @staticmethod
    def backward(ctx, g):
        return _vp2sq(g, ctx.tp_group), None


def all_to_all_vp2sq(vocab_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """[BS, V_local] -> [BS/TP, V]: rank w gets rows [w*BS/TP, (w+1)*BS/TP), columns in vocab order.

    Differentiable (the backward is ``all_to_all_sq2vp``). Needs equal shards on every rank.
    """
    if vocab_parallel_logits.ndim != 2:
        raise ValueError(
            f"all_to_all_vp2sq needs a 2-D [BS, V_local] tensor, got shape {tuple(vocab_parallel_logits.shape)}"
        )
    world = dist.get_world_size(tp_group)
    BS, V_local = vocab_parallel_logits.shape
    if BS % world != 0:
        raise ValueError(f"all_to_all_vp2sq: BS={BS} is not divisible by the TP size {world}")
    _check_same_across(tp_group, vocab_parallel_logits.device, "all_to_all_vp2sq", BS=BS, V_local=V_local)
    return _VP2SQ.apply(vocab_parallel_logits, tp_group)


def all_to_all_sq2vp(seq_parallel_logits: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """[BS/TP, V] -> [BS, V_local]: exact inverse of ``all_to_all_vp2sq``. Differentiable."""
    if seq_parallel_logits.ndim != 2:
        raise ValueError(
            f"all_to_all_sq2vp needs a 2-D [BS/TP, V] tensor, got shape {tuple(seq_parallel_logits.shape)}"
        )
    world = dist.get_world_size(tp_group)
    BS_local, V = seq_parallel_logits.shape
    if V % world != 0:
        raise ValueError(f"all_to_all_sq2vp: V={V} is not divisible by the TP size {world}")
    _check_same_across(tp_group, seq_parallel_logits.device, "all_to_all_sq2vp", BS_local=BS_local, V=V)
    return _SQ2VP.apply(seq_parallel_logits, tp_group)


# ----------------------------------------------------------------------------- top-k / top-p sampling


def _sampling_tuple(sampling_params: Any) -> tuple[Optional[int], float, float]:
    """(top_k, top_p, temperature) of any object with those attributes; None means no sampling."""
    if sampling_params is None:
        return None, 1.0, 1.0
    top_k, top_p, temperature = sampling_params.top_k, sampling_params.top_p, sampling_params.temperature
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return top_k, top_p, temperature


def _need_filtering(top_k: Optional[int], top_p: float) -> bool:
    return (top_k is not None and top_k > 0) or top_p < 1.0


def _filter_logits(x: torch.Tensor, top_k: Optional[int], top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p filtering of full-vocab rows (last dim). Returns (filtered, dropped mask).

    top-k keeps every logit >= the k-th largest (ties may keep more); None or <= 0 disables.
    top-p runs on the top-k-renormalised distribution: sort ascending, drop tokens whose
    cumulative probability is <= 1 - p, always keep the largest; top_p == 1.0 disables.
    """
    V = x.shape[-1]
    dropped = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if top_k is not None and 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        dropped = dropped | (x < kth)  # not in place: masked_fill saved the mask for backward
        x = x.masked_fill(dropped, float("-inf"))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, stable=True)
        drop_sorted = sorted_probs.cumsum(-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False
        dropped = dropped | drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(dropped, float("-inf"))
    return x, dropped


def _sampling_chunk(
    rows: torch.Tensor, target_rows: torch.Tensor, tp_group: dist.ProcessGroup, top_k, top_p, temperature: float
) -> tuple[torch.Tensor, ...]:
    """Vocab-parallel rows [R, V_local] -> this rank's R/TP rows over the full vocab, filtered.

    Returns (logprob at target [R/TP], log_probs [R/TP, V], target, chosen, valid): ``valid`` is
    target in [0, V); ``chosen`` is valid and not filtered out (the target gets the +g term).
    """
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    m = rows.shape[0] // world
    x = _upcast(_vp2sq(rows, tp_group), temperature)
    t = target_rows[rank * m : (rank + 1) * m]
    filtered, dropped = _filter_logits(x, top_k, top_p)
    log_probs = torch.log_softmax(filtered, dim=-1)
    V = x.shape[-1]
    valid = (t >= 0) & (t < V)
    tc = t.clamp(0, V - 1).unsqueeze(-1)
    lp = torch.where(valid, log_probs.gather(-1, tc).squeeze(-1), torch.zeros((), dtype=log_probs.dtype))
    chosen = valid & ~dropped.gather(-1, tc).squeeze(-1)
    return lp, log_probs, t, chosen, valid


def _sampling_chunk_grad(
    softmax: torch.Tensor,
    t: torch.Tensor,
    chosen: torch.Tensor,
    valid: torch.Tensor,
    g: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup,
) -> torch.Tensor:
    """(onehot - softmax) * g on the survivors (softmax is 0 on filtered ids), back to [R, V_local]."""
    g = torch.where(valid, g.to(softmax.dtype), torch.zeros((), dtype=softmax.dtype))
    grad = softmax * -g.unsqueeze(-1)
    V = softmax.shape[-1]
    grad.scatter_add_(-1, t.clamp(0, V - 1).unsqueeze(-1), torch.where(chosen, g, 0.0).unsqueeze(-1))
    if temperature != 1.0:
        grad /= temperature
    # Cast before the all-to-all: same rounding, fewer bytes.
    return _sq2vp(grad.to(dtype), tp_group)


def _gather_chunk_rows(local_lps: list[torch.Tensor], tp_group: dist.ProcessGroup) -> torch.Tensor:
    """One all-gather of every chunk's per-rank rows, reassembled in row order."""
    world = dist.get_world_size(tp_group)
    local = torch.cat(local_lps)
    table = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(table, local, group=tp_group)
    table = table.view(world, -1)
    pieces, offset = [], 0
    for lp in local_lps:  # chunk rows are rank-major: rank w holds rows [w*m, (w+1)*m) of its chunk
        pieces.append(table[:, offset : offset + lp.numel()].reshape(-1))
        offset += lp.numel()
    return torch.cat(pieces)


def _sampling_forward(
    ctx: Any,
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup,
    top_k,
    top_p,
    chunk_size: Optional[int],
    inference_only: bool,
    temperature: float,
) -> torch.Tensor:
    _check_logits("vocab_parallel_logits", logits)
    _check_ids("target", target, logits.shape[:2])
    world = dist.get_world_size(tp_group)
    B, S, V_local = logits.shape
    BS = B * S
    if BS % world != 0:
        raise ValueError(f"top-k/top-p logprobs need B*S divisible by the TP size: B={B}, S={S}, B*S={BS}, TP={world}")
    _check_same_across(tp_group, logits.device, "top-k/top-p logprobs (all-to-all layout)", B=B, S=S, V_local=V_local)
    if chunk_size is None:
        rows_per_chunk = BS
    else:
        # chunk_size * B flattened rows, rounded up to a multiple of TP so that every chunk
        # (the last one too, since BS % TP == 0) splits evenly over the all-to-all.
        rows_per_chunk = min(BS, -(-_check_chunk_size(chunk_size) * B // world) * world)
    rows, flat_target = logits.reshape(BS, V_local), target.reshape(BS).long()

    local_lps = []
    for r0, r1 in _chunks(BS, rows_per_chunk):
        lp, log_probs, t, chosen, valid = _sampling_chunk(
            rows[r0:r1], flat_target[r0:r1], tp_group, top_k, top_p, temperature
        )
        local_lps.append(lp)
    out = _gather_chunk_rows(local_lps, tp_group).view(B, S)

    ctx.inference_only = inference_only
    if not inference_only:
        ctx.chunked = chunk_size is not None
        ctx.tp_group, ctx.top_k, ctx.top_p, ctx.temperature = tp_group, top_k, top_p, temperature
        ctx.rows_per_chunk, ctx.input_dtype, ctx.shape = rows_per_chunk, logits.dtype, (B, S, V_local)
        if ctx.chunked:  # delayed rematerialisation: keep only the inputs
            ctx.save_for_backward(logits, flat_target)
        else:
            ctx.save_for_backward(log_probs.exp_(), t, chosen, valid)
    return out


def _sampling_backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
    _check_saved(ctx)
    B, S, V_local = ctx.shape
    BS = B * S
    rank, world = dist.get_rank(ctx.tp_group), dist.get_world_size(ctx.tp_group)
    g = grad_output.reshape(BS)
    if not ctx.chunked:
        softmax, t, chosen, valid = ctx.saved_tensors
        m = BS // world
        grad = _sampling_chunk_grad(
            softmax, t, chosen, valid, g[rank * m : (rank + 1) * m], ctx.temperature, ctx.input_dtype, ctx.tp_group
        )
        return grad.view(B, S, V_local)

    logits, flat_target = ctx.saved_tensors
    rows = logits.reshape(BS, V_local)
    grad_input = torch.empty(BS, V_local, dtype=ctx.input_dtype, device=logits.device)
    for r0, r1 in _chunks(BS, ctx.rows_per_chunk):
        _, log_probs, t, chosen, valid = _sampling_chunk(
            rows[r0:r1], flat_target[r0:r1], ctx.tp_group, ctx.top_k, ctx.top_p, ctx.temperature
        )
        m = (r1 - r0) // world
        g_rows = g[r0 + rank * m : r0 + (rank + 1) * m]
        grad_input[r0:r1] = _sampling_chunk_grad(
            log_probs.exp_(), t, chosen, valid, g_rows, ctx.temperature, ctx.input_dtype, ctx.tp_group
        )
    return grad_input.view(B, S, V_local)


class DistributedLogprobWithSampling(torch.autograd.Function):
    """[B,S] log-probs under top-k/top-p filtering: all-to-all to [B*S/TP, V], filter each full-vocab
    row, log-softmax over the survivors, gather the target, all-gather back. Filtered target: -inf."""

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup,
        top_k: int | None,
        top_p: float,
        inference_only: bool = False,
    ) -> torch.Tensor:
        return _sampling_forward(ctx, vocab_parallel_logits, target, tp_group, top_k, top_p, None, inference_only, 1.0)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _sampling_backward(ctx, grad_outputs[0]), None, None, None, None, None


class ChunkedDistributedLogprobWithSampling(torch.autograd.Function):
    """DistributedLogprobWithSampling processed chunk by chunk; the backward recomputes each chunk.

    A chunk is ``chunk_size * B`` consecutive rows of the flattened [B*S] positions, rounded up to a
    multiple of TP so every chunk splits evenly over the all-to-all (same memory bound as
    ``chunk_size`` positions of every batch row, no extra divisibility requirement).
    """

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup,
        top_k: int | None,
        top_p: float,
        chunk_size: int,
        inference_only: bool = False,
    ) -> torch.Tensor:
        return _sampling_forward(
            ctx, vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only, 1.0
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _sampling_backward(ctx, grad_outputs[0]), None, None, None, None, None, None


class _ChunkedDistributedLogprobWithSamplingScaled(torch.autograd.Function):
    """ChunkedDistributedLogprobWithSampling of ``logits / temperature`` (scaled per chunk after the upcast)."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, top_k, top_p, chunk_size, inference_only, temperature):
        return _sampling_forward(ctx, logits, target, tp_group, top_k, top_p, chunk_size, inference_only, temperature)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _sampling_backward(ctx, grad_outputs[0]), None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- top-k distillation


class ChunkedDistributedGatherLogprob(torch.autograd.Function):
    """[B,S,K] full-vocab log-probs at global ids, chunked over the sequence.

    Backward: -softmax * sum_k g_k plus g_k at each index (duplicates accumulate), recomputed per chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        global_indices: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        _check_logits("vocab_parallel_logits", vocab_parallel_logits)
        _check_ids("global_indices", global_indices, (*vocab_parallel_logits.shape[:2], global_indices.shape[-1]))
        return _chunked_logprob_forward(
            ctx,
            vocab_parallel_logits,
            global_indices,
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only,
            1.0,
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        return _chunked_logprob_backward(ctx, grad_outputs[0]), None, None, None, None, None, None


class ChunkedDistributedEntropy(torch.autograd.Function):
    """[B,S] H_all = sum_v p_v log p_v (<= 0) over the full vocab, chunked over the sequence.

    Terms with p_v = 0 count as 0. Backward: p * (log p - H) * g, recomputed per chunk.
    """

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        chunk_size: int,
        tp_group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        _check_logits("vocab_parallel_logits", vocab_parallel_logits)
        _check_chunk_size(chunk_size)
        B, S, _ = vocab_parallel_logits.shape
        out = torch.zeros(B, S, dtype=_compute_dtype(vocab_parallel_logits.dtype), device=vocab_parallel_logits.device)
        for s0, s1 in _chunks(S, chunk_size):
            p, safe_log_p = _p_and_safe_log_p(vocab_parallel_logits[:, s0:s1], tp_group)
            out[:, s0:s1] = (p * safe_log_p).sum(-1)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=tp_group)

        ctx.inference_only = inference_only
        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, out)
            ctx.chunk_size, ctx.tp_group = chunk_size, tp_group
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        _check_saved(ctx)
        logits, h_all = ctx.saved_tensors
        grad_output = grad_outputs[0]
        grad_input = torch.empty_like(logits)
        for s0, s1 in _chunks(logits.shape[1], ctx.chunk_size):
            p, safe_log_p = _p_and_safe_log_p(logits[:, s0:s1], ctx.tp_group)
            grad = p * (safe_log_p - h_all[:, s0:s1, None]) * grad_output[:, s0:s1, None].to(p.dtype)
            grad_input[:, s0:s1] = grad
        return grad_input, None, None, None


def _p_and_safe_log_p(logits: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, log p with 0 where p == 0) on the local shard: a -inf logit gives no NaN."""
    log_p = _compute_distributed_log_softmax(logits, group)
    p = log_p.exp()
    return p, log_p.masked_fill_(p == 0, 0.0)


class _AllReduceSum(torch.autograd.Function):
    """SUM all-reduce whose output is replicated, so its backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


@torch.no_grad()
def distributed_vocab_topk(
    vocab_parallel_logits: torch.Tensor,
    k: int,
    tp_group: dist.ProcessGroup,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k over the sharded vocab: values [B,S,k] (descending, compute dtype; exact copies of
    the logits) and int64 global ids. No gradient."""
    _check_logits("vocab_parallel_logits", vocab_parallel_logits)
    _check_vocab_range(vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index)
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive int, got {k!r}")
    B, S, V_local = vocab_parallel_logits.shape
    world = dist.get_world_size(tp_group)
    k_local = min(k, V_local)

    vals, ids = [], []
    for s0, s1 in _chunks(S, S if chunk_size is None else _check_chunk_size(chunk_size)):
        v, i = torch.topk(_upcast(vocab_parallel_logits[:, s0:s1]), k_local, dim=-1)
        # Pad every rank's candidates to k (id -1) so the all-gather has equal sizes on uneven shards.
        v = torch.nn.functional.pad(v, (0, k - k_local), value=float("-inf")).contiguous()
        i = torch.nn.functional.pad(i + vocab_start_index, (0, k - k_local), value=-1).contiguous()
        all_v = torch.empty(world * v.numel(), dtype=v.dtype, device=v.device)
        all_i = torch.empty(world * i.numel(), dtype=i.dtype, device=i.device)
        dist.all_gather_into_tensor(all_v, v.view(-1), group=tp_group)
        dist.all_gather_into_tensor(all_i, i.view(-1), group=tp_group)
        all_v = all_v.view(world, B, s1 - s0, k).permute(1, 2, 0, 3).reshape(B, s1 - s0, world * k)
        all_i = all_i.view(world, B, s1 - s0, k).permute(1, 2, 0, 3).reshape(B, s1 - s0, world * k)
        n_real = int((all_i[0, 0] >= 0).sum())
        if n_real < k:
            raise ValueError(f"k={k} is larger than the vocab size {n_real}")
        # Real candidates first, then a stable sort: a padding slot never wins a tie with a real -inf logit.
        real_first = torch.argsort((all_i < 0).to(torch.uint8), dim=-1, stable=True)
        all_v, all_i = all_v.gather(-1, real_first), all_i.gather(-1, real_first)
        top_v, pos = torch.sort(all_v, dim=-1, descending=True, stable=True)
        vals.append(top_v[..., :k])
        ids.append(all_i.gather(-1, pos[..., :k]))
    return torch.cat(vals, dim=1), torch.cat(ids, dim=1)


class _GatherInComputeDtype(torch.autograd.Function):
    """values.gather(-1, index) in the compute dtype.  The backward adds the gradients of repeated
    indices in the compute dtype and rounds each position once (torch.gather's backward would add them
    in a bfloat16 input's own dtype); K x K per token, no V-sized buffer."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype = values.shape, values.dtype
        return _upcast(values.gather(-1, index))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        (index,) = ctx.saved_tensors
        same = index.unsqueeze(-1) == index.unsqueeze(-2)  # [..., K, K]
        summed = (same * grad_output.unsqueeze(-2)).sum(-1)  # each entry: the sum over its repeats
        K = index.shape[-1]
        earlier = torch.ones(K, K, dtype=torch.bool, device=index.device).tril(-1)
        first = ~(same & earlier).any(-1)  # the first of its repeats carries the sum, the others 0
        grad = grad_output.new_zeros(ctx.shape, dtype=ctx.dtype)
        grad.scatter_add_(-1, index, torch.where(first, summed, torch.zeros((), dtype=summed.dtype)).to(ctx.dtype))
        return grad, None


def gather_logits_at_global_indices(
    vocab_parallel_logits: torch.Tensor,
    global_indices: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """[B,S,K] raw logits (compute dtype) at global ids; differentiable w.r.t. the logits.

    Logits [B,S/CP,V_local] in the head-tail CP layout; ``global_indices`` [B,S,K] for the full
    sequence; the result is the full sequence on every rank.  ``tp_group=None``: the local tensor
    holds the full vocab.  ``chunk_size`` is accepted but changes nothing: the K picked logits are
    upcast after the gather, so no V-sized fp32 buffer exists.
    """
    _check_logits("vocab_parallel_logits", vocab_parallel_logits)
    cp_size, cp_rank = _cp_size_rank(cp_group)
    B, S_local, V_local = vocab_parallel_logits.shape
    positions = _head_tail_positions(S_local * cp_size, cp_size)
    _check_ids("global_indices", global_indices, (B, S_local * cp_size, global_indices.shape[-1]))
    _check_vocab_range(V_local, vocab_start_index, vocab_end_index)
    if chunk_size is not None:
        _check_chunk_size(chunk_size)
    local_indices = _get_tokens_on_this_cp_rank(global_indices, cp_rank, cp_size, seq_dim=1).long()
    picked, _ = _gather_owned(vocab_parallel_logits, local_indices, vocab_start_index, _GatherInComputeDtype.apply)
    picked = _upcast(picked)  # (an empty shard's zeros come in the logits' dtype)
    if tp_group is not None:
        picked = _AllReduceSum.apply(picked, tp_group)
    return _gather_cp(picked, cp_group, 1, positions)


class _LocalEntropy(torch.autograd.Function):
    """sum_v p_v log p_v on a full-vocab local tensor (terms with p_v = 0 count as 0), with the closed-form
    gradient p * (log p - H) * g as ChunkedDistributedEntropy has.  Autograd through p * log p subtracts two
    nearly equal terms at the row's max and loses an almost one-hot row's gradient there entirely."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(_upcast(logits), dim=-1)
        p = log_p.exp()
        safe_log_p = log_p.masked_fill_(p == 0, 0.0)
        h = (p * safe_log_p).sum(-1)
        ctx.save_for_backward(p, safe_log_p, h)
        ctx.input_dtype = logits.dtype
        return h

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> torch.Tensor:
        p, safe_log_p, h = ctx.saved_tensors
        return (p * (safe_log_p - h[..., None]) * grad_h[..., None].to(p.dtype)).to(ctx.input_dtype)


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(student_topk_logprobs, teacher_topk_logprobs, H_all or None), last position dropped.

    Teacher: log-softmax over its K logits. Student: full-vocab log-probs at the K ids
    (``zero_outside_topk``) or log-softmax within the K ids. H_all: student entropy sum p log p.
    Student logits: vocab-parallel (with group and rank, even shards), a DTensor, or a full tensor;
    with ``context_parallel_group`` they are [B,S/CP,·] in the head-tail layout, while the teacher's
    logits and ids are the full [B,S,K]; every result is the full sequence on every rank.
    """
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(
            f"top-k width must be positive, got teacher_topk_indices of shape {tuple(teacher_topk_indices.shape)}"
        )
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
        local, group = student_logits, vocab_parallel_group
        V_local = local.shape[-1]
        start, end = vocab_parallel_rank * V_local, (vocab_parallel_rank + 1) * V_local
    elif _is_dtensor(student_logits):
        local, group, start, end = _dtensor_vocab_shard(student_logits)
    else:
        local, group, start, end = student_logits, None, 0, student_logits.shape[-1]
    _check_logits("student_logits", local)
    cp_size, cp_rank = _cp_size_rank(context_parallel_group)
    positions = _head_tail_positions(local.shape[1] * cp_size, cp_size)
    indices = teacher_topk_indices.to(local.device).long()
    _check_ids("teacher_topk_indices", indices, (local.shape[0], positions.numel(), indices.shape[-1]))
    local_indices = _get_tokens_on_this_cp_rank(indices, cp_rank, cp_size, seq_dim=1)
    chunk_size = max(1, min(local.shape[1], 1024))

    if zero_outside_topk:
        if group is not None:
            student = ChunkedDistributedGatherLogprob.apply(local, local_indices, start, end, chunk_size, group, False)
        else:
            student, _ = _gather_owned(torch.log_softmax(_upcast(local), dim=-1), local_indices, 0)
        student = _gather_cp(student, context_parallel_group, 1, positions)
    else:
        picked = gather_logits_at_global_indices(
            local, indices, group, context_parallel_group, vocab_start_index=start, vocab_end_index=end
        )
        student = torch.log_softmax(picked, dim=-1)
    h_all = None
    if calculate_entropy:
        h_all = (
            ChunkedDistributedEntropy.apply(local, chunk_size, group, False)
            if group is not None
            else _LocalEntropy.apply(local)
        )
        h_all = _gather_cp(h_all, context_parallel_group, 1, positions)[:, :-1]
    teacher = torch.log_softmax(_upcast(teacher_topk_logits.to(local.device)), dim=-1)
    return student[:, :-1], teacher[:, :-1], h_all


# ----------------------------------------------------------------------------- hidden states -> logprobs


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[S/TP, ...] -> [S, ...]: concatenate the sequence shards of the TP group in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=group)
    return out.view(world * x.shape[0], *x.shape[1:])


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[S, ...] partial sums on every rank -> this rank's summed [S/TP, ...] shard.

    Done as all-to-all + local sum, which gloo supports on every device.
    """
    world = dist.get_world_size(group)
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x.contiguous(), group=group)
    return recv.view(world, x.shape[0] // world, *x.shape[1:]).sum(0)


def _hidden_chunk_logits(hidden_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c,B,H] x [V_local,H] -> [B,c,V_local] logits in the input dtype (an LM head's projection)."""
    return torch.matmul(hidden_chunk, weight.t()).transpose(0, 1)


class ChunkedDistributedHiddenStatesToLogprobs(torch.autograd.Function):
    """[B,S] log-probs of ``target`` (already shifted) from sequence-parallel hidden states [S/TP,B,H]
    and the vocab-parallel output weight [V_local,H].

    The hidden states are all-gathered along S; the logits are built ``chunk_size`` positions at a
    time, so the full [B,S,V_local] fp32 logits never exist. The backward recomputes them per chunk,
    reduce-scatters the hidden-state gradient back to the sequence shard; the weight gradient is local.
    """

    @staticmethod
    def forward(
        ctx: Any,
        tensor_parallel_hidden_states: torch.Tensor,
        target: torch.Tensor,
        output_weight_layer: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        hidden, weight = tensor_parallel_hidden_states, output_weight_layer
        _check_logits("tensor_parallel_hidden_states", hidden)
        _check_logits("output_weight", weight, ndim=2)
        if weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[2]:
            raise ValueError(
                f"output weight {tuple(weight.shape)} {weight.dtype} does not fit hidden states "
                f"{tuple(hidden.shape)} {hidden.dtype}"
            )
        S = hidden.shape[0] * dist.get_world_size(tp_group)
        _check_ids("target", target, (hidden.shape[1], S))
        _check_vocab_range(weight.shape[0], vocab_start_index, vocab_end_index)
        _check_chunk_size(chunk_size)
        target = target.long()

        full = _all_gather_seq(hidden, tp_group)
        picked = torch.zeros(target.shape, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
        owned = torch.zeros(target.shape, dtype=torch.bool, device=hidden.device)
        for s0, s1 in _chunks(S, chunk_size):
            log_probs = _compute_distributed_log_softmax(_hidden_chunk_logits(full[s0:s1], weight), tp_group)
            p, o = _gather_owned(log_probs, target[:, s0:s1, None], vocab_start_index)
            picked[:, s0:s1], owned[:, s0:s1] = p.squeeze(-1), o.squeeze(-1)
        out, valid = _sum_with_owner_count(picked, owned, tp_group)

        ctx.inference_only = inference_only
        if not inference_only:
            # Keep the local shard only; the backward all-gathers it again (sequence-parallel style).
            ctx.save_for_backward(hidden, weight, target, valid)
            ctx.vocab_start_index, ctx.chunk_size, ctx.tp_group = vocab_start_index, chunk_size, tp_group
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        _check_saved(ctx)
        hidden, weight, target, valid = ctx.saved_tensors
        grad_output = grad_outputs[0]
        full = _all_gather_seq(hidden, ctx.tp_group)
        S, B, H = full.shape
        compute = _compute_dtype(hidden.dtype)
        weight_c = weight.to(compute)
        grad_full = torch.empty(S, B, H, dtype=compute, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device)
        for s0, s1 in _chunks(S, ctx.chunk_size):
            softmax = _compute_distributed_softmax(_hidden_chunk_logits(full[s0:s1], weight), ctx.tp_group)
            grad_logits = _gather_logprob_grad(
                softmax,
                target[:, s0:s1, None],
                valid[:, s0:s1, None],
                grad_output[:, s0:s1, None],
                ctx.vocab_start_index,
            )  # [B,c,V_local]
            grad_full[s0:s1] = torch.matmul(grad_logits, weight_c).transpose(0, 1)
            h = full[s0:s1].transpose(0, 1).to(compute)  # [B,c,H]
            # flatten, not reshape(-1, V_local): an empty vocab shard (V_local = 0) has no -1 to infer
            grad_weight += grad_logits.flatten(0, 1).t() @ h.flatten(0, 1)
        # Every rank used the whole gathered sequence: sum the partial gradients, keep our shard.
        grad_hidden = _reduce_scatter_seq(grad_full, ctx.tp_group)
        return grad_hidden.to(hidden.dtype), None, grad_weight.to(weight.dtype), None, None, None, None, None


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: Any,
    output_weight: Optional[torch.Tensor],
    runtime_gather_output: bool,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """[B,L-1] next-token log-probs from sequence-parallel hidden states [S/(CP·TP),B,H].

    With CP the sequence is laid out head-tail over CP first, then each CP rank's part is split
    contiguously over TP (sequence parallelism).  The weight [V_local,H] is ``output_weight``, else
    ``output_weight_layer`` (a tensor or a module with ``.weight``).  ``target`` is the unshifted
    full [B,L] input ids, L ≤ S (padded with 0, the padding stripped from the result).
    ``runtime_gather_output`` is a Megatron flag with no effect here.  ``chunk_size=None``
    processes this rank's whole sequence at once.  The result is the full sequence on every rank.
    """
    weight = output_weight if output_weight is not None else getattr(output_weight_layer, "weight", output_weight_layer)
    if weight is None:
        raise ValueError("no output weight: output_weight and output_weight_layer are both None")
    _check_logits("tensor_parallel_hidden_states", tensor_parallel_hidden_states)
    cp_size, cp_rank = _cp_size_rank(cp_group)
    S_cp = tensor_parallel_hidden_states.shape[0] * dist.get_world_size(tp_group)  # this CP rank's positions
    positions = _head_tail_positions(S_cp * cp_size, cp_size)
    _check_target("target", target, tensor_parallel_hidden_states.shape[1], positions.numel())
    local_target = _shift_pad_and_take(target, positions.numel(), positions, cp_rank)
    logprobs = ChunkedDistributedHiddenStatesToLogprobs.apply(
        tensor_parallel_hidden_states,
        local_target,
        weight,
        vocab_start_index,
        vocab_end_index,
        S_cp if chunk_size is None else chunk_size,
        tp_group,
        inference_only,
    )
    logprobs = _gather_cp(logprobs, cp_group, 1, positions)
    return logprobs[:, : target.shape[1] - 1].contiguous()


# ----------------------------------------------------------------------------- DTensor / dispatch front ends


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _dtensor_vocab_shard(x: Any) -> tuple[torch.Tensor, Optional[dist.ProcessGroup], int, int]:
    """(local tensor, TP group, vocab start, vocab end) of a [B,S,V] DTensor.

    The TP group is the mesh group of the dim whose placement is Shard(last dim); None when the
    vocab is not sharded (the local tensor then holds the full vocab).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements, ndim = x.device_mesh, x.placements, x.ndim
    vocab_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == ndim - 1]
    if len(vocab_dims) > 1:
        raise ValueError(f"vocab dim sharded over several mesh dims {vocab_dims}: placements {placements}")
    local = x.to_local()
    if not vocab_dims:
        return local, None, 0, x.shape[-1]
    local_shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    return local, mesh.get_group(vocab_dims[0]), offset[-1], offset[-1] + local_shape[-1]


def _seq_shard_group(x: Any) -> tuple[Optional[dist.ProcessGroup], int]:
    """(group, size) of the mesh dim over which DTensor ``x`` shards its sequence dim (dim 1):
    its context-parallel group; (None, 1) for a plain tensor or an unsharded sequence."""
    if not _is_dtensor(x):
        return None, 1
    from torch.distributed.tensor import Shard

    dims = [
        i
        for i, p in enumerate(x.placements)
        if isinstance(p, Shard) and p.dim % x.ndim == 1 and x.device_mesh.size(i) > 1
    ]
    if len(dims) > 1:
        raise ValueError(f"sequence dim sharded over several mesh dims {dims}: placements {x.placements}")
    if not dims:
        return None, 1
    return x.device_mesh.get_group(dims[0]), x.device_mesh.size(dims[0])


def _cp_layout(seq_index: Optional[torch.Tensor], seq_len: int, cp_size: int) -> torch.Tensor:
    """Positions table of a DTensor sequence shard: the ``seq_index`` permutation, or without one the
    DTensor's own contiguous Shard(1).  ``seq_index`` is ignored without context parallelism."""
    if cp_size == 1 or seq_index is None:
        if seq_len % cp_size:
            raise ValueError(f"sequence length {seq_len} is not divisible by CP = {cp_size}")
        return torch.arange(seq_len).view(cp_size, seq_len // cp_size)
    if seq_index.numel() != seq_len:
        raise ValueError(f"seq_index has {seq_index.numel()} positions, the sequence {seq_len}")
    return _permutation_positions(seq_index, cp_size)


def _full_ids(ids: Any, positions: torch.Tensor, cp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Input ids as a full-sequence local tensor: a DTensor's sequence shards are all-gathered over CP
    (ids are per-token scalars) and put back in natural order through ``positions``."""
    if not _is_dtensor(ids):
        return ids
    group, size = _seq_shard_group(ids)
    local = ids.to_local()
    if group is None:
        return local
    if size != positions.shape[0]:
        raise ValueError(f"input ids are sharded over {size} ranks, the logits over {positions.shape[0]}")
    return _gather_positions(local, group, 1, positions)


def _full_vocab_logprobs(logits: torch.Tensor, target: torch.Tensor, sampling_params: Any) -> torch.Tensor:
    """[B,S] log-probs of an already shifted target from full-vocab logits: temperature, filtering,
    log-softmax, gather (ids outside [0, V): 0)."""
    top_k, top_p, temperature = _sampling_tuple(sampling_params)
    x = _upcast(logits, temperature)
    if _need_filtering(top_k, top_p):
        x, _ = _filter_logits(x, top_k, top_p)
    picked, _ = _gather_owned(torch.log_softmax(x, dim=-1), target[..., None].long(), 0)
    return picked.squeeze(-1)


def dtensor_from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: Any,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: dist.ProcessGroup,
    inference_only: bool = False,
    seq_index: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """[B,S-1] next-token log-probs from vocab-parallel logits [B,S/CP,V_local].

    ``target`` is the unshifted input ids: a plain full [B,S] tensor (no CP), or a DTensor whose
    sequence dim is sharded over the CP mesh dim; the CP layout of both the target's and the logits'
    sequence shards is the permutation ``seq_index`` (rank r holds ``seq_index[r·S/CP:(r+1)·S/CP]``),
    or the DTensor's contiguous Shard(1) when it is None.  The result is in natural order on every rank.
    """
    _check_logits("vocab_parallel_logits", vocab_parallel_logits)
    cp_group, cp_size = _seq_shard_group(target)
    positions = _cp_layout(seq_index, vocab_parallel_logits.shape[1] * cp_size, cp_size)
    ids = _full_ids(target, positions, cp_group)
    return _next_token_logprobs(
        vocab_parallel_logits,
        ids,
        positions,
        cp_group,
        _cp_size_rank(cp_group)[1],
        vocab_start_index,
        vocab_end_index,
        tp_group,
        inference_only,
        chunk_size,
        sampling_params,
    )


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits: Any,
    input_ids: Any,
    seq_index: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """[B,S-1] next-token log-probs from DTensor logits [B,S,V]: the TP group and vocab range come from
    the placement of the vocab dim (uneven shards included), the CP group from that of the sequence
    dim, whose layout is ``seq_index`` (see ``dtensor_from_parallel_logits_to_logprobs``).
    ``input_ids``: a DTensor laid out like the logits' sequence, or a plain full [B,S] tensor."""
    if not _is_dtensor(vocab_parallel_logits):
        raise ValueError(f"vocab_parallel_logits must be a DTensor, got {type(vocab_parallel_logits).__name__}")
    local, tp_group, start, end = _dtensor_vocab_shard(vocab_parallel_logits)
    cp_group, cp_size = _seq_shard_group(vocab_parallel_logits)
    positions = _cp_layout(seq_index, vocab_parallel_logits.shape[1], cp_size)
    ids = _full_ids(input_ids, positions, cp_group)
    return _next_token_logprobs(
        local,
        ids,
        positions,
        cp_group,
        _cp_size_rank(cp_group)[1],
        start,
        end,
        tp_group,
        not torch.is_grad_enabled(),
        chunk_size,
        sampling_params,
    )


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: Optional[torch.Tensor] = None,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """[B,L-1] next-token log-probs of the unshifted ids [B,L]: vocab-parallel logits with a group (even
    shards, this rank's range from ``vocab_parallel_rank``), a DTensor, or a plain full-vocab tensor.
    With ``context_parallel_group`` the plain and vocab-parallel logits are [B,S/CP,·] in the head-tail
    layout (S ≥ L, padded); a DTensor carries its own CP layout (``seq_index``)."""
    if _is_dtensor(next_token_logits) and vocab_parallel_group is None:
        return get_logprobs_from_vocab_parallel_logits(
            next_token_logits, input_ids, seq_index=seq_index, sampling_params=sampling_params
        )
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
        V_local = next_token_logits.shape[-1]
        start, end = vocab_parallel_rank * V_local, (vocab_parallel_rank + 1) * V_local
    else:
        start, end = 0, next_token_logits.shape[-1]
    _check_logits("next_token_logits", next_token_logits)
    cp_size, cp_rank = _cp_size_rank(context_parallel_group)
    positions = _head_tail_positions(next_token_logits.shape[1] * cp_size, cp_size)
    return _next_token_logprobs(
        next_token_logits,
        input_ids,
        positions,
        context_parallel_group,
        cp_rank,
        start,
        end,
        vocab_parallel_group,
        not torch.is_grad_enabled(),
        None,
        sampling_params,
    )


# Megatron-Core's GPTModel with the linear + log-prob fusion (the mechanics: distributed_impl/_linear_ce_fusion.py).


def patch_gpt_model_forward_for_linear_ce_fusion(*, chunk_size: int) -> None:
    """Patch Megatron-Core's GPTModel.forward for the fused log-prob path; a second call only updates chunk_size."""
    _linear_ce_fusion._install(_gpt_forward_with_linear_ce_fusion, chunk_size)


def _gpt_forward_with_linear_ce_fusion(
    self: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoder_input: torch.Tensor = None,
    labels: torch.Tensor = None,
    inference_context: Any = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Optional[dict] = None,
    runtime_gather_output: Optional[bool] = None,
    *,
    inference_params: Optional[Any] = None,
    loss_mask: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    return_logprobs_for_linear_ce_fusion: bool = False,
) -> torch.Tensor:
    """GPTModel.forward with the fused log-prob path (distributed_impl/_linear_ce_fusion.py); without the flag, the
    original."""
    if not return_logprobs_for_linear_ce_fusion:
        return _linear_ce_fusion._original_forward()(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input,
            labels,
            inference_context,
            packed_seq_params,
            extra_block_kwargs,
            runtime_gather_output,
            inference_params=inference_params,
            loss_mask=loss_mask,
            padding_mask=padding_mask,
        )
    return _linear_ce_fusion._fused_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input,
        labels,
        inference_context,
        packed_seq_params,
        extra_block_kwargs,
        runtime_gather_output,
        inference_params,
        loss_mask,
        padding_mask,
        from_parallel_hidden_states_to_logprobs,
    )
