"""An independently written cp_utils (seed nemo_automodel.components.distributed.cp_utils), built the
way the seed's upstream is: torch's own `context_parallel` shards the buffers and patches SDPA,
`set_rotate_method` picks the K/V rotation, and the THD path partitions with Transformer Engine's
`thd_get_partitioned_indices`.  Nothing of shardcheck is imported.

On a GPU with TE this runs as it is.  On CPU it needs what torch 2.13 and TE do not provide there,
shardcheck's CPU shims (harness/shims): a ring-attention handler for the CPU SDPA op inside torch's
CP dispatch, and a stand-in for `transformer_engine_torch`.  `shardcheck run --no-shims` shows the
failure without them.

Where torch 2.13 would silently do something else than the seed's semantics, it refuses or works
around it, as a careful caller of torch would:
- a sequence length not divisible by 2·CP: torch falls back to contiguous chunks without a word
  (no load balancing); `create_context_parallel_ctx` raises ValueError instead, and
  `make_cp_batch_and_ctx` pads the batch on the right first;
- `resize_` refuses tensors that require grad: a trainable `inputs_embeds` is sharded out of place,
  by torch's own head-tail load balancer, so its gradient flows.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Set

import torch
from torch.distributed.device_mesh import DeviceMesh

ROTATE_METHODS = ("allgather", "alltoall")
# Right-padding to a multiple of 2·CP: padded tokens carry no loss and are masked.
PAD_VALUES = {"input_ids": 0, "inputs_embeds": 0.0, "labels": -100, "position_ids": 0, "loss_mask": 0,
              "padding_mask": True}


def _build_position_ids(batch, device):
    """Add position_ids = arange(S)[None] when missing; returns the batch."""
    if "position_ids" not in batch:
        tokens = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
        batch["position_ids"] = torch.arange(0, tokens.shape[1], device=device).unsqueeze(0)
    return batch


def get_train_context(enable_loss_parallel: bool, enable_compiled_autograd: bool, cp_context=None):
    """A factory of the train context: loss parallel, compiled autograd, then the CP context."""

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


@contextlib.contextmanager
def _context_parallel(cp_mesh, buffers, seq_dims, no_restore, rotate_method):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate_method)  # process-global in torch: set when this context is entered
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore):
        yield


def create_context_parallel_ctx(
    cp_mesh: DeviceMesh,
    cp_buffers: List[torch.Tensor],
    cp_seq_dims: List[int],
    cp_no_restore_buffers: Set[torch.Tensor],
    cp_rotate_method: Optional[str] = None,
):
    """torch's context_parallel over `cp_buffers`, with `cp_rotate_method` ("allgather" when None)."""
    rotate_method = cp_rotate_method or "allgather"
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"cp_rotate_method must be one of {ROTATE_METHODS}, got {cp_rotate_method!r}")
    n = 2 * cp_mesh.size()
    for buffer, dim in zip(cp_buffers, cp_seq_dims):
        if buffer.shape[dim] % n:  # torch would shard it in contiguous chunks instead of head-tail
            raise ValueError(f"sequence length {buffer.shape[dim]} (dim {dim} of a {tuple(buffer.shape)} buffer) "
                             f"is not divisible by 2·CP = {n}")
    return _context_parallel(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, rotate_method)


def _right_pad(t: torch.Tensor, dim: int, pad: int, value) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim)


def _head_tail_shard(t: torch.Tensor, dim: int, cp_mesh) -> torch.Tensor:
    """This rank's load-balanced piece of `t` along `dim`, out of place (differentiable), by torch's
    own head-tail load balancer, as context_parallel shards its buffers."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    index = _HeadTailLoadBalancer(t.shape[dim], cp_mesh.size(), t.device)._generate_indices()[0]
    return t.index_select(dim, index).chunk(cp_mesh.size(), dim=dim)[cp_mesh.get_local_rank()]


@contextlib.contextmanager
def _batch_context(batch: dict, cp_mesh, cp_ctx):
    embeds = batch.get("inputs_embeds")
    if embeds is not None and embeds.requires_grad:  # torch cannot resize it in place
        batch["inputs_embeds"] = _head_tail_shard(embeds, 1, cp_mesh)
    with cp_ctx:
        yield


def make_cp_batch_and_ctx(
    device_mesh,
    batch,
    loss_mask=None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
):
    """(context factory, batch): the batch padded to a multiple of 2·CP and sharded by torch's
    context_parallel when the context is entered.  No CP: (nullcontext, batch)."""
    if device_mesh is None or "cp" not in (device_mesh.mesh_dim_names or ()):
        return contextlib.nullcontext, batch
    cp_mesh = device_mesh["cp"]
    if cp_mesh.size() <= 1:
        return contextlib.nullcontext, batch
    if use_te:
        return contextlib.nullcontext, make_cp_batch_for_te(cp_mesh, batch, padding_token_id=padding_token_id,
                                                            num_chunks=num_chunks,
                                                            seq_lens_padding_value=seq_lens_padding_value)
    if (batch.get("input_ids") is None) == (batch.get("inputs_embeds") is None):
        raise ValueError("the batch needs exactly one of input_ids and inputs_embeds")
    batch.pop("attention_mask", None)  # CP attention is causal; a mask would not be sharded with it
    key = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    tokens = batch[key]
    _build_position_ids(batch, tokens.device)
    if batch["position_ids"].dim() == 2:
        batch["position_ids"] = batch["position_ids"].expand(tokens.shape[0], -1).contiguous()
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask

    pad = -tokens.shape[1] % (2 * cp_mesh.size())
    seq_dims = {key: 1, "labels": 1, "position_ids": batch["position_ids"].dim() - 1, "loss_mask": 1,
                "padding_mask": 1}
    names = [k for k in seq_dims if batch.get(k) is not None]
    for name in names:
        batch[name] = _right_pad(batch[name], seq_dims[name], pad, PAD_VALUES[name])
    in_place = [k for k in names if not (k == "inputs_embeds" and batch[k].requires_grad)]
    buffers = [batch[k] for k in in_place]
    no_restore = {batch[k] for k in in_place if k != "position_ids"}
    cp_ctx = create_context_parallel_ctx(cp_mesh, buffers, [seq_dims[k] for k in in_place], no_restore,
                                         cp_rotate_method="allgather")
    return get_train_context(False, False, _batch_context(batch, cp_mesh, cp_ctx)), batch


def _to_thd(batch, seq_lens_padding_value: int) -> dict:
    """One group of rows, BSHD -> THD: the packs of every row concatenated, sentinel packs dropped."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    device = input_ids.device
    keep = {"input_ids": [], "labels": [], "position_ids": [], "padding_mask": []}
    real, padded = [], []
    for row in range(input_ids.shape[0]):
        start = 0
        for length, padded_length in zip(batch["seq_lens"][row].tolist(), batch["seq_lens_padded"][row].tolist()):
            if seq_lens_padding_value in (length, padded_length):
                continue
            span = slice(start, start + padded_length)
            keep["input_ids"].append(input_ids[row, span])
            keep["labels"].append(labels[row, span])
            positions = torch.arange(padded_length, device=device)
            keep["position_ids"].append(batch["position_ids"][row, span] if "position_ids" in batch else positions)
            keep["padding_mask"].append(positions >= length)
            real.append(length)
            padded.append(padded_length)
            start += padded_length
    out = {k: torch.cat(v) for k, v in keep.items()}
    out["cu_seqlens"] = torch.tensor([0] + real, device=device).cumsum(0).to(torch.int32)
    out["cu_seqlens_padded"] = torch.tensor([0] + padded, device=device).cumsum(0).to(torch.int32)
    out["max_seqlen"] = torch.tensor(max(padded, default=0), dtype=torch.int32, device=device)
    out["qkv_format"] = "thd"
    return out


def _shard_thd_chunk_for_te(batch, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id):
    """One group of rows already in THD format (_to_thd's); with CP, this rank's tokens of every packed sequence, by
    TE's thd_get_partitioned_indices."""
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    thd = {**batch, "qkv_format": "thd"}
    if cp_mesh is None or cp_mesh.size() <= 1:
        return thd
    import transformer_engine_torch as tex

    cu_padded, n = thd["cu_seqlens_padded"], 2 * cp_mesh.size()
    cu_padded = cu_padded[cu_padded != seq_lens_padding_value]
    lengths = (cu_padded[1:] - cu_padded[:-1]).tolist()
    if any(length % n for length in lengths):  # TE checks this only in a device-side assert
        raise ValueError(f"padded sequence lengths {lengths} must be divisible by 2·CP = {n}")
    index = tex.thd_get_partitioned_indices(cu_padded, int(cu_padded[-1]), cp_mesh.size(), cp_mesh.get_local_rank())
    for key in ("input_ids", "labels", "position_ids", "padding_mask"):
        thd[key] = thd[key].index_select(0, index.long())
    return thd


def make_cp_batch_for_te(
    cp_mesh,
    batch,
    qkv_format="thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
):
    """BSHD -> THD, sharded per packed sequence over CP; num_chunks > 1 splits the rows into groups,
    each converted on its own and stacked (right-padded; ragged cu_seqlens padded with the sentinel)."""
    if qkv_format != "thd":
        raise ValueError(f"qkv_format must be 'thd', got {qkv_format!r}")
    missing = [k for k in ("seq_lens", "seq_lens_padded") if k not in batch]
    if missing:
        raise KeyError(f"make_cp_batch_for_te needs {missing} in the batch")
    if num_chunks <= 1:
        return _shard_thd_chunk_for_te(_to_thd(batch, seq_lens_padding_value), cp_mesh, qkv_format,
                                       seq_lens_padding_value, padding_token_id)
    rows = batch["input_ids"].shape[0]
    if rows % num_chunks:
        raise ValueError(f"batch size {rows} is not divisible by num_chunks {num_chunks}")
    per = rows // num_chunks
    keys = [k for k in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded") if k in batch]
    groups = [_shard_thd_chunk_for_te(_to_thd({k: batch[k][i * per:(i + 1) * per] for k in keys},
                                              seq_lens_padding_value),
                                      cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id)
              for i in range(num_chunks)]
    fills = {"input_ids": padding_token_id, "labels": -100, "position_ids": 0, "padding_mask": True,
             "cu_seqlens": seq_lens_padding_value, "cu_seqlens_padded": seq_lens_padding_value}
    out = {}
    for key, fill in fills.items():
        width = max(g[key].shape[0] for g in groups)
        out[key] = torch.stack([_right_pad(g[key], 0, width - g[key].shape[0], fill) for g in groups])
    out["max_seqlen"] = torch.stack([g["max_seqlen"] for g in groups]).max()
    out["qkv_format"] = "thd"
    return out
