"""A pure-torch stand-in for Transformer Engine's `transformer_engine_torch.thd_get_partitioned_indices`.

Code that shards packed (THD) batches for context parallelism imports TE's extension inside the
function (`import transformer_engine_torch as tex`) and calls this one function, a CUDA kernel in
TE.  Where TE is not installed (a CPU machine), `install()` registers a module of that name that
holds only this function, so such code runs; a real install is never shadowed.

The rule, as TE's kernel computes it: every packed sequence is cut into 2·world equal chunks and
rank r takes chunks r and 2·world−1−r of each sequence, sequences in order; `total_tokens / world`
indices (int32).  Its input checks are TE's too (TE raises RuntimeError through NVTE_CHECK; the
per-sequence divisibility is a device-side assert there, a RuntimeError here).  Like the kernel,
tokens past `cu_seqlens[-1]` are attributed to the last sequence (out-of-range or repeated
indices): callers strip sentinel entries and trailing padding first.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

NAME = "Transformer Engine's thd_get_partitioned_indices (transformer_engine_torch)"
MODULE = "transformer_engine_torch"
CALLS = 0  # calls the stand-in took in this process: the run says whether it was used


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """Indices of the tokens rank `rank` of `world_size` holds of a THD batch with boundaries `cu_seqlens`."""
    global CALLS
    CALLS += 1
    _check(cu_seqlens.dtype == torch.int32, f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    _check(cu_seqlens.dim() == 1, f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    _check(cu_seqlens.shape[0] >= 2, f"cu_seqlens needs at least 2 entries, got {cu_seqlens.shape[0]}")
    _check(0 <= rank < world_size, f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
    _check(world_size > 0, f"world_size must be positive, got {world_size}")
    _check(
        total_tokens > 0 and total_tokens % (2 * world_size) == 0,
        f"total_tokens must be a positive multiple of 2·world_size = {2 * world_size}, got {total_tokens}",
    )
    bounds = cu_seqlens.long()
    bad = bounds % (2 * world_size) != 0
    _check(
        not bool(bad.any()),
        f"every cu_seqlens entry must be divisible by 2·world_size = {2 * world_size}, "
        f"got {bounds[bad].tolist()} in {bounds.tolist()}",
    )
    local_bounds = bounds // world_size  # where each sequence starts among this rank's tokens
    token = torch.arange(total_tokens // world_size, device=cu_seqlens.device)
    # The kernel's binary search: the last sequence whose start is <= the token, among sequences
    # 0..batch-1 (a token past the end lands in the last one).
    seq = torch.searchsorted(local_bounds[1:-1].contiguous(), token, right=True)
    start = local_bounds[seq]
    half = (local_bounds[seq + 1] - start) // 2  # one chunk
    index = token - start
    chunk = torch.where(index < half, torch.full_like(index, rank), torch.full_like(index, 2 * world_size - 2 - rank))
    return (index + start * world_size + half * chunk).to(torch.int32)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"thd_get_partitioned_indices (shardcheck's CPU stand-in for Transformer Engine): {message}")


def te_installed() -> bool:
    """Whether a real transformer_engine_torch can be imported (then it is never shadowed)."""
    module = sys.modules.get(MODULE)
    if module is not None:
        return not getattr(module, "__shardcheck_shim__", False)
    try:
        return importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        return False


def _missing_attribute(name: str):
    raise AttributeError(
        f"module {MODULE!r} is shardcheck's CPU stand-in for Transformer Engine and provides only "
        f"thd_get_partitioned_indices; {name} needs Transformer Engine itself"
    )


def install() -> None:
    """Make `import transformer_engine_torch` give the stand-in (only when TE is not installed)."""
    if te_installed():
        raise RuntimeError(f"{MODULE} is installed: shardcheck does not shadow it")
    module = types.ModuleType(
        MODULE,
        "shardcheck's CPU stand-in for Transformer Engine's extension: "
        "thd_get_partitioned_indices only (harness/shims/te_thd_partition.py)",
    )
    module.thd_get_partitioned_indices = thd_get_partitioned_indices
    module.__shardcheck_shim__ = True
    module.__getattr__ = _missing_attribute
    sys.modules[MODULE] = module


def uninstall() -> None:
    if getattr(sys.modules.get(MODULE), "__shardcheck_shim__", False):
        del sys.modules[MODULE]


def installed() -> bool:
    return getattr(sys.modules.get(MODULE), "__shardcheck_shim__", False)
