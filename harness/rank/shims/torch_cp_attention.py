"""CPU shim for torch's context parallelism: ring attention for the CPU flash SDPA op.

torch 2.13's `context_parallel` routes SDPA through DTensor: q/k/v become `Shard(2)` DTensors and,
while the context is open, `DTensor._op_dispatcher._custom_op_handlers` maps the CUDA SDPA ops
(flash, efficient, cuDNN, and their backwards) onto its ring attention.  That table is rebuilt on
every enter from the module-level dict `_attention.custom_ops`.  On CPU, SDPA lowers to
`aten._scaled_dot_product_flash_attention_for_cpu` (and `..._backward`), which is in neither that
dict nor the CP sharding rules, so every CP step stops with "does not have a sharding strategy".

`install()` adds handlers for the two CPU ops to `custom_ops`: torch then installs and removes
them with its own on enter and exit, and they run on torch's own ring
(`_templated_ring_attention` and its backward twin, rotate method and load balancing as set).
The handlers build the output specs themselves (`Shard(2)`, like the CUDA ops' CP strategy), so no
sharding rule is registered and DTensor SDPA outside CP is unchanged.

Accumulation dtype: torch merges the per-step results in float32 (`_cp_options.convert_to_f32`),
which would return float64 attention with ~1e-7 error; the CUDA ops it was written for do not take
float64 at all.  Here the merge runs in max(float32, input dtype): float64 stays float64, float32
and lower merge in float32 exactly as torch does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

NAME = "torch context parallelism (CPU SDPA ring attention)"
CALLS = 0  # attention calls (forward or backward) this process's handlers took: the run says whether it was used
TORCH_SERIES = "2.13."  # the private modules below are read as they are in this series
SEQ_DIM = 2  # torch's CP shards q/k/v [B, H, S, D] on dim 2 (hard-coded there too)

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def unavailable_reason() -> str | None:
    """Why the shim cannot be installed in this process, or None."""
    if not torch.__version__.startswith(TORCH_SERIES):
        return (
            f"shardcheck's CPU shim for torch context parallelism was written for torch {TORCH_SERIES}x "
            f"(private modules of torch.distributed.tensor.experimental._context_parallel); this is torch "
            f"{torch.__version__}"
        )
    if not dist.is_available():
        return "torch.distributed is not available in this build of torch"
    return None


def _attention_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def install() -> None:
    """Add the CPU handlers to torch's CP handler table (idempotent).  Raises RuntimeError on a
    torch this shim was not written for."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    attention = _attention_module()
    for name in ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options"):
        if not hasattr(attention, name):  # the same series, but not the layout this was read from
            raise RuntimeError(
                f"torch {torch.__version__}: _context_parallel._attention has no {name}; "
                "shardcheck's CPU shim for torch context parallelism cannot be installed"
            )
    attention.custom_ops[FORWARD] = _cpu_sdpa_handler
    attention.custom_ops[BACKWARD] = _cpu_sdpa_handler


@contextlib.contextmanager
def _merge_dtype_at_least(dtype: torch.dtype):
    """torch's merge/accumulation dtype for this call: float32 unless the input is wider."""
    options = _attention_module()._cp_options
    saved = options.convert_to_f32
    options.convert_to_f32 = torch.promote_types(dtype, torch.float32) == torch.float32
    try:
        yield
    finally:
        options.convert_to_f32 = saved


def _spec(mesh, shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    """A Shard(2) spec of a tensor of global `shape`."""
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), dtype)
    return DTensorSpec(mesh, (Shard(SEQ_DIM),), tensor_meta=meta)


def _by_name(op_call, args, kwargs) -> dict:
    return {a.name: v for a, v in zip(op_call._schema.arguments, args)} | dict(kwargs)


def _cpu_sdpa_handler(op_call, args, kwargs):
    """DTensor handler of the CPU flash SDPA op and its backward inside torch's CP context."""
    global CALLS
    CALLS += 1
    attention = _attention_module()
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = op_info.compute_mesh
    full = _by_name(op_call, args, kwargs)  # DTensors: global shapes
    placements = [tuple(v.placements) for v in full.values() if isinstance(v, DTensor)]
    if mesh.ndim != 1 or any(p != (Shard(SEQ_DIM),) for p in placements):
        raise NotImplementedError(
            f"context-parallel CPU attention ({op_call}) expects q, k, v sharded Shard({SEQ_DIM}) on a 1-D CP mesh, "
            f"got {placements} on a {mesh.ndim}-D mesh"
        )
    local = _by_name(op_call, op_info.local_args, op_info.local_kwargs)
    if local.get("attn_mask") is not None:  # as torch's CUDA handlers: the ring has no attention bias
        raise NotImplementedError("context-parallel attention does not support attn_mask (use is_causal=True)")
    group = mesh.get_group()
    wrap = DTensor._op_dispatcher.wrap
    with _merge_dtype_at_least(local["query"].dtype):
        if op_call is FORWARD:
            out, lse = attention._templated_ring_attention(
                group,
                SEQ_DIM,
                FORWARD,
                query=local["query"],
                key=local["key"],
                value=local["value"],
                is_causal=local.get("is_causal", False),
                dropout_p=local.get("dropout_p", 0.0),
                scale=local.get("scale"),
            )
            shape = full["query"].shape
            return wrap(out, _spec(mesh, shape, out.dtype)), wrap(lse, _spec(mesh, shape[:-1], lse.dtype))
        grads = attention._templated_ring_attention_backward(
            group,
            SEQ_DIM,
            BACKWARD,
            grad_out=local["grad_out"],
            grad_out_name="grad_out",
            query=local["query"],
            key=local["key"],
            value=local["value"],
            out=local["out"],
            logsumexp=local["logsumexp"],
            is_causal=local["is_causal"],
            dropout_p=local["dropout_p"],
            scale=local.get("scale"),
        )
    return tuple(
        wrap(g, _spec(mesh, full[name].shape, g.dtype)) for g, name in zip(grads[:3], ("query", "key", "value"))
    )
