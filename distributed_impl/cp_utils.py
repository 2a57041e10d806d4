"""Context parallelism for a training step (seed nemo_automodel.components.distributed.cp_utils).

Same public names and signatures as the seed module; semantics in docs/ops/cp_utils.md.
Everything here runs on CPU with gloo (and on CUDA): the CP attention is a ring attention written
in plain torch, and the THD partition is Transformer Engine's `thd_get_partitioned_indices` rule
written in plain torch.

Head-tail layout: a sequence of S positions is cut into 2·CP chunks of c = S / (2·CP); CP rank r
holds chunks r and 2·CP−1−r.  Inside the context `torch.nn.functional.scaled_dot_product_attention`
is replaced by `_ring_sdpa`: each rank's queries attend to every rank's keys, one chunk pair at a
time, and partial results are merged by log-sum-exp.  A chunk pair (query chunk a, key chunk b) is
fully visible when b < a, causal within the chunk when b == a, and skipped when b > a, so no query
row ever meets a fully masked block (no NaN).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Set

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

ROTATE_METHODS = ("allgather", "alltoall")
# Right-padding of the batch to a multiple of 2·CP: padded tokens carry no loss and are masked.
PAD_FILLS = {
    "input_ids": 0,
    "inputs_embeds": 0.0,
    "labels": -100,
    "position_ids": 0,
    "loss_mask": 0,
    "padding_mask": True,
}
# Query rows per score block: rows·(keys per chunk) ≤ BLOCK_ELEMENTS bounds the transient
# [B, H, rows, c] scores (and their backward's p, dp, ds), so attention memory shrinks ~1/CP.
BLOCK_ELEMENTS = 1 << 15


def _block_rows(n_keys: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(n_keys, 1))


# ---- head-tail positions ---------------------------------------------------------------------


def _head_tail_index(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions CP rank `cp_rank` holds of `length`: chunks r and 2·CP−1−r of 2·CP."""
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2·CP = {2 * cp_size} (CP = {cp_size})")
    chunk = length // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


def _chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_visibility(q_chunk: int, k_chunk: int) -> str:
    """How query chunk `q_chunk` sees key chunk `k_chunk` under a causal mask (global chunk ids)."""
    if k_chunk < q_chunk:
        return "full"
    if k_chunk == q_chunk:
        return "causal"
    return "none"


# ---- ring attention ----------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or better for the softmax and the merges; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _block_forward(q, k, v, scale: float, causal: bool):
    """Attention of q [B, H, n, D] against one key chunk k, v [B, H, c, D] (compute dtype):
    (out, lse).  `causal`: q and k are the same chunk; query row i sees keys 0..i."""
    outs, lses = [], []
    step = _block_rows(k.shape[-2])
    for i0 in range(0, q.shape[-2], step):
        qb = q[..., i0 : i0 + step, :]
        scores = torch.matmul(qb, k.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(i0, i0 + qb.shape[-2], device=q.device)
            future = torch.arange(k.shape[-2], device=q.device)[None, :] > rows[:, None]
            scores = scores.masked_fill(future, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse[..., None]), v))
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _block_backward(q, k, v, out, lse, dout, delta, scale: float, causal: bool):
    """Gradients (dq, dk, dv) of one chunk pair, from the merged out/lse (recomputed scores)."""
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    step = _block_rows(k.shape[-2])
    for i0 in range(0, q.shape[-2], step):
        sl = slice(i0, i0 + step)
        qb = q[..., sl, :]
        scores = torch.matmul(qb, k.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(i0, i0 + qb.shape[-2], device=q.device)
            future = torch.arange(k.shape[-2], device=q.device)[None, :] > rows[:, None]
            scores = scores.masked_fill(future, float("-inf"))
        p = torch.exp(scores - lse[..., sl, None])
        dv += torch.matmul(p.transpose(-1, -2), dout[..., sl, :])
        dp = torch.matmul(dout[..., sl, :], v.transpose(-1, -2))
        ds = p * (dp - delta[..., sl, None]) * scale
        dq[..., sl, :] = torch.matmul(ds, k)
        dk += torch.matmul(ds.transpose(-1, -2), qb)
    return dq, dk, dv


def _merge(out, lse, out_b, lse_b):
    """Log-sum-exp merge of two partial attentions over disjoint key sets."""
    if out is None:
        return out_b, lse_b
    out = out - torch.sigmoid(lse_b - lse)[..., None] * (out - out_b)
    lse = lse - F.logsigmoid(lse - lse_b)
    return out, lse


class _Rotator:
    """Where the K/V blocks come from: all-gathered once, or passed around the ring (all-to-all)."""

    def __init__(self, group, method: str):
        self.group = group
        self.method = method
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        """[CP, *kv.shape]: every rank's block (one all-gather)."""
        out = torch.empty((self.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        dist.all_gather_into_tensor(out, kv.contiguous(), group=self.group)
        return out.view(self.size, *kv.shape)

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        """Send `t` to the next rank of the ring, receive the previous rank's (one all-to-all)."""
        t = t.contiguous()
        recv = torch.empty_like(t)
        send_sizes = [0] * self.size
        recv_sizes = [0] * self.size
        send_sizes[(self.rank + 1) % self.size] = t.shape[0]
        recv_sizes[(self.rank - 1) % self.size] = t.shape[0]
        dist.all_to_all_single(recv, t, recv_sizes, send_sizes, group=self.group)
        return recv

    def reduce_to_owners(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [CP, ...]: this rank's contribution to every rank's block -> the sum for its own."""
        out = torch.empty(partial.shape[1:], dtype=partial.dtype, device=partial.device)
        dist.reduce_scatter_tensor(out, partial.contiguous().flatten(0, 1), group=self.group)
        return out


def _split_kv(kv: torch.Tensor):
    """A stacked [2, B, H, 2c, D] K/V block -> ((k_head, v_head), (k_tail, v_tail)) chunks."""
    c = kv.shape[-2] // 2
    return (kv[0, ..., :c, :], kv[1, ..., :c, :]), (kv[0, ..., c:, :], kv[1, ..., c:, :])


class _RingAttention(torch.autograd.Function):
    """Exact causal attention of head-tail-sharded q, k, v [B, H, 2c, D] over the whole sequence.

    Saves only q, k, v, out and lse (like flash attention); the backward recomputes the scores
    chunk pair by chunk pair and sends every K/V gradient back to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, rotator: _Rotator):
        cdt = _compute_dtype(q.dtype)
        n, r = rotator.size, rotator.rank
        q_chunks = _chunk_ids(n, r)
        c = q.shape[-2] // 2
        qc = q.to(cdt)
        qs = (qc[..., :c, :], qc[..., c:, :])
        acc = [[None, None], [None, None]]  # per query chunk: (out, lse)
        kv = torch.stack([k, v])
        blocks = rotator.gather(kv) if rotator.method == "allgather" and n > 1 else None
        for step in range(n):
            src = (r - step) % n
            if blocks is not None:
                kv_src = blocks[src]
            elif step == 0:
                kv_src = kv
            else:
                kv_src = rotator.shift(kv_src)
            for k_chunk, (kb, vb) in zip(_chunk_ids(n, src), _split_kv(kv_src)):
                for i, q_chunk in enumerate(q_chunks):
                    seen = _chunk_visibility(q_chunk, k_chunk)
                    if seen == "none":
                        continue
                    out_b, lse_b = _block_forward(qs[i], kb.to(cdt), vb.to(cdt), scale, seen == "causal")
                    acc[i] = list(_merge(acc[i][0], acc[i][1], out_b, lse_b))
        out = torch.cat([acc[0][0], acc[1][0]], -2)
        lse = torch.cat([acc[0][1], acc[1][1]], -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.rotator = scale, rotator
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, rotator = ctx.scale, ctx.rotator
        cdt = out.dtype
        n, r = rotator.size, rotator.rank
        q_chunks = _chunk_ids(n, r)
        c = q.shape[-2] // 2
        qc, doutc = q.to(cdt), dout.to(cdt)
        delta = (doutc * out).sum(-1)  # rowsum(dO ∘ O), per query row
        halves = (slice(0, c), slice(c, 2 * c))
        dq = torch.zeros_like(qc)
        kv = torch.stack([k, v])
        blocks = rotator.gather(kv) if rotator.method == "allgather" and n > 1 else None
        dkv_all = torch.zeros((n, *kv.shape), dtype=cdt, device=q.device) if blocks is not None else None
        dkv = None
        for step in range(n):
            src = (r - step) % n
            if blocks is not None:
                kv_src = blocks[src]
                dkv = dkv_all[src]
            elif step == 0:
                kv_src, dkv = kv, torch.zeros(kv.shape, dtype=cdt, device=q.device)
            else:  # the K/V block moves on with the gradient accumulated for it so far
                kv_src, dkv = rotator.shift(kv_src), rotator.shift(dkv)
            for j, (k_chunk, (kb, vb)) in enumerate(zip(_chunk_ids(n, src), _split_kv(kv_src))):
                kb, vb = kb.to(cdt), vb.to(cdt)
                for i, q_chunk in enumerate(q_chunks):
                    seen = _chunk_visibility(q_chunk, k_chunk)
                    if seen == "none":
                        continue
                    qi = halves[i]
                    dq_b, dk_b, dv_b = _block_backward(
                        qc[..., qi, :],
                        kb,
                        vb,
                        out[..., qi, :],
                        lse[..., qi],
                        doutc[..., qi, :],
                        delta[..., qi],
                        scale,
                        seen == "causal",
                    )
                    dq[..., qi, :] += dq_b
                    dkv[0, ..., halves[j], :] += dk_b
                    dkv[1, ..., halves[j], :] += dv_b
        if blocks is not None:
            dkv = rotator.reduce_to_owners(dkv_all)
        elif n > 1:  # after n-1 steps this rank holds the gradient of rank r+1's block: send it home
            dkv = rotator.shift(dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _ring_sdpa(rotator: _Rotator, original: Callable):
    """The SDPA that runs inside the CP context."""

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if attn_mask is not None or not is_causal:
            raise NotImplementedError(
                "context-parallel attention is causal only (is_causal=True, no attn_mask); "
                "drop attention_mask from the batch"
            )
        if dropout_p:
            raise NotImplementedError("context-parallel attention does not support dropout")
        if key.shape[-3] != query.shape[-3]:
            if not enable_gqa:
                raise ValueError(f"query has {query.shape[-3]} heads, key {key.shape[-3]}: pass enable_gqa=True")
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        if query.shape[-2] % 2:
            raise ValueError(f"local sequence length {query.shape[-2]} is not two equal head-tail chunks")
        if scale is None:
            scale = query.shape[-1] ** -0.5
        return _RingAttention.apply(query, key, value, float(scale), rotator)

    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


# ---- the CP context ------------------------------------------------------------------------


class _ContextParallel:
    """Shard buffers in place on enter, ring attention inside, restore on exit."""

    def __init__(self, cp_mesh: DeviceMesh, buffers, seq_dims, no_restore, rotate_method: str):
        self.cp_mesh = cp_mesh
        self.buffers = list(buffers)
        self.seq_dims = list(seq_dims)
        self.no_restore = list(no_restore)
        self.rotate_method = rotate_method
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self._saved: list[torch.Tensor | None] = []
        self._original_sdpa = None

    def __enter__(self):
        self._saved = []
        for i, (buf, dim) in enumerate(zip(self.buffers, self.seq_dims)):
            if buf.requires_grad:  # torch cannot resize it; make_cp_batch_and_ctx shards inputs_embeds out of place
                raise ValueError(f"buffer {i} requires grad: it cannot be sharded in place")
            index = _head_tail_index(buf.shape[dim], self.cp_size, self.cp_rank, buf.device)
            shard = buf.index_select(dim, index)
            restore = not any(buf is x for x in self.no_restore)
            self._saved.append(buf.clone() if restore else None)
            buf.resize_(shard.shape)
            buf.copy_(shard)
        group = self.cp_mesh.get_group() if self.cp_size > 1 else None
        self._original_sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _ring_sdpa(_Rotator(group, self.rotate_method), self._original_sdpa)
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._original_sdpa
        for buf, saved in zip(self.buffers, self._saved):
            if saved is not None:
                buf.resize_(saved.shape)
                buf.copy_(saved)
        self._saved = []
        return False


def create_context_parallel_ctx(
    cp_mesh: DeviceMesh,
    cp_buffers: List[torch.Tensor],
    cp_seq_dims: List[int],
    cp_no_restore_buffers: Set[torch.Tensor],
    cp_rotate_method: Optional[str] = None,
):
    """A context manager: buffers sharded head-tail in place on enter, exact causal ring attention
    inside, buffers not in `cp_no_restore_buffers` restored on exit."""
    method = "allgather" if cp_rotate_method is None else cp_rotate_method
    if method not in ROTATE_METHODS:
        raise ValueError(f"cp_rotate_method must be one of {ROTATE_METHODS} (or None), got {cp_rotate_method!r}")
    if len(cp_buffers) != len(cp_seq_dims):
        raise ValueError(f"{len(cp_buffers)} buffers but {len(cp_seq_dims)} seq dims")
    cp_size = cp_mesh.size()
    for i, (buf, dim) in enumerate(zip(cp_buffers, cp_seq_dims)):
        if buf.shape[dim] % (2 * cp_size):
            raise ValueError(
                f"buffer {i} {tuple(buf.shape)}: sequence length {buf.shape[dim]} (dim {dim}) is not "
                f"divisible by 2·CP = {2 * cp_size}"
            )
    return _ContextParallel(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers or (), method)


def get_train_context(enable_loss_parallel: bool, enable_compiled_autograd: bool, cp_context=None):
    """A factory of the train context: loss_parallel (if enabled), compiled autograd (if enabled),
    then `cp_context`, entered in that order."""

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            if enable_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if enable_compiled_autograd:
                from torch._dynamo.utils import maybe_enable_compiled_autograd

                stack.enter_context(maybe_enable_compiled_autograd(True))
            if cp_context is not None:
                stack.enter_context(cp_context)
            yield

    return context


# ---- batches -------------------------------------------------------------------------------


def _build_position_ids(batch, device):
    """Add position_ids = arange(S)[None] when missing; returns the batch."""
    if "position_ids" not in batch:
        primary = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
        batch["position_ids"] = torch.arange(primary.shape[1], device=device).unsqueeze(0)
    return batch


def _pad_seq(t: torch.Tensor, dim: int, pad: int, value) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim)


class _BatchContext:
    """make_cp_batch_and_ctx's context: shards a trainable inputs_embeds out of place, then the CP context."""

    def __init__(self, batch: dict, cp_ctx: _ContextParallel, cp_size: int, cp_rank: int):
        self.batch, self.cp_ctx, self.cp_size, self.cp_rank = batch, cp_ctx, cp_size, cp_rank

    def __enter__(self):
        embeds = self.batch.get("inputs_embeds")
        if embeds is not None and embeds.requires_grad:
            index = _head_tail_index(embeds.shape[1], self.cp_size, self.cp_rank, embeds.device)
            self.batch["inputs_embeds"] = embeds.index_select(1, index)  # differentiable
        return self.cp_ctx.__enter__()

    def __exit__(self, *exc):
        return self.cp_ctx.__exit__(*exc)


def make_cp_batch_and_ctx(
    device_mesh,
    batch,
    loss_mask=None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
):
    """(ctx_factory, batch): the batch padded to a multiple of 2·CP and sharded head-tail when the
    context is entered.  No mesh, or a CP size of 1: (nullcontext, batch) unchanged."""
    if device_mesh is None or "cp" not in (device_mesh.mesh_dim_names or ()) or device_mesh["cp"].size() <= 1:
        return contextlib.nullcontext, batch
    cp_mesh = device_mesh["cp"]
    if use_te:
        return contextlib.nullcontext, make_cp_batch_for_te(
            cp_mesh,
            batch,
            padding_token_id=padding_token_id,
            num_chunks=num_chunks,
            seq_lens_padding_value=seq_lens_padding_value,
        )
    has_ids, has_embeds = batch.get("input_ids") is not None, batch.get("inputs_embeds") is not None
    if has_ids == has_embeds:
        raise ValueError(
            "the batch needs exactly one of input_ids and inputs_embeds, got " + ("both" if has_ids else "neither")
        )
    batch.pop("attention_mask", None)  # CP attention is causal: a mask cannot be sharded with it
    primary_key = "input_ids" if has_ids else "inputs_embeds"
    primary = batch[primary_key]
    _build_position_ids(batch, primary.device)
    if batch["position_ids"].dim() == 2 and batch["position_ids"].shape[0] != primary.shape[0]:
        batch["position_ids"] = batch["position_ids"].expand(primary.shape[0], -1).contiguous()
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask

    cp_size = cp_mesh.size()
    seq_len = primary.shape[1]
    pad = (-seq_len) % (2 * cp_size)
    # name -> (seq dim, fill for right padding)
    fills = {
        primary_key: (1, PAD_FILLS[primary_key]),
        "labels": (1, PAD_FILLS["labels"]),
        "position_ids": (2 if batch["position_ids"].dim() == 3 else 1, PAD_FILLS["position_ids"]),
        "loss_mask": (1, PAD_FILLS["loss_mask"]),
        "padding_mask": (1, PAD_FILLS["padding_mask"]),
    }
    names = [k for k in fills if batch.get(k) is not None]
    for name in names:
        dim, fill = fills[name]
        batch[name] = _pad_seq(batch[name], dim, pad, fill)
    trainable_embeds = primary_key == "inputs_embeds" and batch[primary_key].requires_grad
    in_place = [k for k in names if not (k == "inputs_embeds" and trainable_embeds)]
    buffers = [batch[k] for k in in_place]
    no_restore = {batch[k] for k in in_place if k != "position_ids"}
    cp_ctx = create_context_parallel_ctx(
        cp_mesh, buffers, [fills[k][0] for k in in_place], no_restore, cp_rotate_method="allgather"
    )
    batch_ctx = _BatchContext(batch, cp_ctx, cp_size, cp_mesh.get_local_rank())
    return get_train_context(False, False, batch_ctx), batch


# ---- THD packed batches --------------------------------------------------------------------


def _thd_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Transformer Engine's thd_get_partitioned_indices in plain torch: rank r keeps chunks r and
    2·CP−1−r of the 2·CP equal chunks of every packed sequence, sequences in order."""
    bounds = [int(b) for b in cu_seqlens_padded]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp_size):
            raise ValueError(f"padded sequence length {end - start} is not divisible by 2·CP = {2 * cp_size}")
        pieces.append(start + _head_tail_index(end - start, cp_size, cp_rank, cu_seqlens_padded.device))
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=cu_seqlens_padded.device)
    return torch.cat(pieces)


def _to_thd(batch, padding_token_id: int, seq_lens_padding_value: int) -> dict:
    """One chunk of rows, BSHD -> THD (unsharded): packs concatenated, sentinel packs skipped."""
    if "seq_lens" not in batch or "seq_lens_padded" not in batch:
        missing = [k for k in ("seq_lens", "seq_lens_padded") if k not in batch]
        raise KeyError(f"THD conversion needs {missing} in the batch")
    input_ids, labels = batch["input_ids"], batch["labels"]
    position_ids = batch.get("position_ids")
    seq_lens, seq_lens_padded = batch["seq_lens"], batch["seq_lens_padded"]
    device = input_ids.device
    ids, labs, pos, pad_mask, real, padded = [], [], [], [], [], []
    for row in range(input_ids.shape[0]):
        offset = 0
        for length, padded_length in zip(seq_lens[row].tolist(), seq_lens_padded[row].tolist()):
            if padded_length == seq_lens_padding_value or length == seq_lens_padding_value:
                continue  # an absent pack
            span = slice(offset, offset + padded_length)
            ids.append(input_ids[row, span])
            labs.append(labels[row, span])
            pos.append(
                position_ids[row, span] if position_ids is not None else torch.arange(padded_length, device=device)
            )
            pad_mask.append(torch.arange(padded_length, device=device) >= length)  # by position, not by token id
            real.append(length)
            padded.append(padded_length)
            offset += padded_length
    cu = torch.tensor([0] + real, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return {
        "input_ids": torch.cat(ids),
        "labels": torch.cat(labs),
        "position_ids": torch.cat(pos),
        "cu_seqlens": cu,
        "cu_seqlens_padded": cu_padded,
        "max_seqlen": torch.tensor(max(padded, default=0), dtype=torch.int32, device=device),
        "qkv_format": "thd",
        "padding_mask": torch.cat(pad_mask),
    }


def _shard_thd_chunk_for_te(batch, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id):
    """One THD chunk, as make_cp_batch_for_te converted a group of rows (tokens [T], cu_seqlens, cu_seqlens_padded
    with any sentinel entries, max_seqlen): this CP rank's tokens of every packed sequence."""
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    if "cu_seqlens_padded" not in batch:
        raise KeyError("_shard_thd_chunk_for_te takes a THD batch: 'cu_seqlens_padded' is missing")
    thd = {**batch, "qkv_format": "thd"}
    if cp_mesh is None or cp_mesh.size() <= 1:
        return thd
    bounds = thd["cu_seqlens_padded"]
    index = _thd_partition_index(bounds[bounds != seq_lens_padding_value], cp_mesh.size(), cp_mesh.get_local_rank())
    for key in ("input_ids", "labels", "position_ids", "padding_mask"):
        if key in thd:
            thd[key] = thd[key].index_select(0, index)
    return thd


def make_cp_batch_for_te(
    cp_mesh,
    batch,
    qkv_format="thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
):
    """BSHD -> THD, sharded per packed sequence over CP.  num_chunks > 1: rows split into groups,
    each converted on its own, stacked (token tensors right-padded to the longest group: ids
    padding_token_id, labels -100, positions 0, padding_mask True; cu_seqlens with the sentinel)."""
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    for key in ("seq_lens", "seq_lens_padded"):
        if key not in batch:
            raise KeyError(f"make_cp_batch_for_te needs {key!r} in the batch")
    rows = batch["input_ids"].shape[0]
    if num_chunks <= 1:
        thd = _to_thd(batch, padding_token_id, seq_lens_padding_value)
        return _shard_thd_chunk_for_te(thd, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id)
    if rows % num_chunks:
        raise ValueError(f"batch size {rows} is not divisible by num_chunks = {num_chunks}")
    per = rows // num_chunks
    keys = [k for k in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded") if k in batch]
    parts = [
        _shard_thd_chunk_for_te(
            _to_thd({k: batch[k][i * per : (i + 1) * per] for k in keys}, padding_token_id, seq_lens_padding_value),
            cp_mesh,
            qkv_format,
            seq_lens_padding_value,
            padding_token_id,
        )
        for i in range(num_chunks)
    ]
    fills = {
        "input_ids": padding_token_id,
        "labels": -100,
        "position_ids": 0,
        "padding_mask": True,
        "cu_seqlens": seq_lens_padding_value,
        "cu_seqlens_padded": seq_lens_padding_value,
    }
    out = {}
    for key, fill in fills.items():
        longest = max(p[key].shape[0] for p in parts)
        out[key] = torch.stack([_pad_seq(p[key], 0, longest - p[key].shape[0], fill) for p in parts])
    out["max_seqlen"] = torch.stack([p["max_seqlen"] for p in parts]).max()
    out["qkv_format"] = "thd"
    return out
