"""Process-group utilities: the API of nemo_automodel.components.distributed.utils.

Semantics: docs/ops/distributed_utils.md.  Everything here uses the
default (world) process group unless a group is passed, and works without torch.distributed
(a single process).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ContextDecorator, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

_DIST_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---- losses ---------------------------------------------------------------------------------


def reduce_loss(
    loss_store: list[torch.Tensor],
    total_num_tokens: torch.Tensor,
    per_token_loss: bool = True,
    dp_group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, denominator), not divided: loss = the sum of `loss_store` ([1], detached, float32 or
    better); denominator = `total_num_tokens` (int64: a count past 2**31 is kept exactly) when
    `per_token_loss`, else the number of losses.  Both summed over `dp_group` when given."""
    if len(loss_store) == 0:
        raise ValueError("reduce_loss: loss_store is empty")
    device = loss_store[0].device
    dtype = reduce(torch.promote_types, (loss.dtype for loss in loss_store), torch.float32)
    loss = torch.stack([part.detach().to(device, dtype).sum() for part in loss_store]).sum().reshape(1)
    if per_token_loss:
        tokens = torch.as_tensor(total_num_tokens)
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool or tokens.numel() != 1:
            raise ValueError(
                f"reduce_loss: total_num_tokens must be one integer, got {tokens.dtype} of shape {tuple(tokens.shape)}"
            )
        denominator = tokens.detach().to(device, torch.int64).reshape(1).clone()
    else:
        denominator = torch.tensor([len(loss_store)], dtype=torch.int64, device=device)
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)
        dist.all_reduce(denominator, group=dp_group)
    return loss, denominator


# ---- evaluation sharding ----------------------------------------------------------------------


@dataclass
class DDPConfig:
    """Data parallel with the full model replicated on every rank (DistributedDataParallel)."""


@dataclass
class FSDP2Config:
    """Data parallel with parameters sharded over the ranks (`fully_shard`)."""


@dataclass
class MegatronFSDPConfig:
    """Data parallel with parameters sharded over the ranks (Megatron-FSDP)."""


def _is_ddp(distributed_config: Any) -> bool:
    """Whether the config is upstream's DDPConfig or a stand-in of it (this module's, a caller's): told by the class
    name, since upstream's class (nemo_automodel.components.distributed.config) is not importable here."""
    return any(cls.__name__ == "DDPConfig" for cls in type(distributed_config).__mro__)


def dp_eval_sample_shard(distributed_config: Any, dp_rank: int, dp_size: int) -> tuple | None:
    """(dp_rank, dp_size) when each DP rank may score its own eval samples: only under DDP with
    dp_size > 1.  Sharded models (FSDP2, Megatron-FSDP) issue per-layer collectives in generate(),
    which must stay in lockstep, so every rank scores the same samples: None."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_eval_sample_shard: dp_rank {dp_rank} is not in [0, dp_size {dp_size})")
    if _is_ddp(distributed_config) and dp_size > 1:
        return dp_rank, dp_size
    return None


# ---- gradient accumulation --------------------------------------------------------------------


def get_sync_ctx(model, is_optim_step, defer_fsdp_grad_sync: bool):
    """The context to run one micro-batch's forward and backward in.

    FSDP2: gradient sync switched to `is_optim_step` when deferring (fewer reduce-scatters, unsharded
    gradients held meanwhile), else on; a null context.  DDP, or any wrapper with a `no_sync()`
    (Megatron-FSDP's, not a DDP subclass): `model.no_sync()` except on the optimizer step, so
    gradients are reduced once, on the last micro-batch.  Anything else: a null context."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(bool(is_optim_step) if defer_fsdp_grad_sync else True)
        return nullcontext()
    no_sync = getattr(model, "no_sync", None)
    if callable(no_sync) and not is_optim_step:
        return no_sync()
    return nullcontext()


# ---- barriers ---------------------------------------------------------------------------------

_BARRIER_CALLS: dict[str, int] = {}  # per group: calls so far (every rank calls in the same order)


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    """True when every rank of `group` (default: all) arrives within `timeout`; False otherwise.

    Store-based, not a collective: a gloo (monitored) barrier that times out closes its group's
    connections, so that group fails from then on.  Here the ranks count arrivals in the process
    group's store and the outcome is decided once, atomically (compare_set): the last rank to
    arrive decides "ok", a rank whose timeout expires first decides "timeout".  Every rank returns
    the same decision; a late rank learns the barrier was abandoned and gets False at once.  No
    process group is touched, so they all keep working."""
    if not _distributed():
        return True
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if size == 1:
        return True
    key = ",".join(map(str, dist.get_process_group_ranks(group)))
    call = _BARRIER_CALLS.get(key, 0)
    _BARRIER_CALLS[key] = call + 1
    store = dist.PrefixStore(f"barrier_with_timeout/{key}/{call}/", dist.distributed_c10d._get_default_store())
    end = time.monotonic() + seconds
    if store.add("arrived", 1) >= size:
        decision = store.compare_set("decision", "", "ok")
    else:
        while not store.check(["decision"]):
            if time.monotonic() >= end:
                break
            time.sleep(0.005)
        decision = store.compare_set("decision", "", "timeout")  # the decision made, if one was
    return decision == b"ok"


def _create_gloo_group():
    """A gloo process group over all ranks (None without torch.distributed): monitored_barrier
    works on it whatever the main backend, and a timeout there leaves the main group intact."""
    if not _distributed():
        return None
    return dist.new_group(backend="gloo")


def barrier_and_log(string: str) -> None:
    """A barrier over all ranks, then `string` logged once, by rank 0."""
    if _distributed():
        dist.barrier()
        if dist.get_rank() != 0:
            return
    logger.info(string)


class FirstRankPerNode(ContextDecorator):
    """The first rank of each node (LOCAL_RANK 0) runs the block first and gets True; the other
    ranks wait (a barrier) until it has finished, then run it and get False.

    Without torch.distributed (no process group, no RANK/WORLD_SIZE/MASTER_* in the environment)
    it is a plain block returning True.  When the environment describes a job and no process group
    exists yet, one is created (gloo on CPU, nccl on GPUs) and destroyed on exit.  An exception in
    the block on a rank tears its process group down before propagating: its peers, waiting in a
    barrier for it, fail at once instead of hanging."""

    def __enter__(self, timeout: timedelta = timedelta(hours=10)):
        self._created_pg = False
        self._first = True
        if not dist.is_available():
            return True
        if not dist.is_initialized():
            if not all(k in os.environ for k in _DIST_ENV):
                return True
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
            dist.init_process_group(backend=backend, timeout=timeout)
            self._created_pg = True
            # Every rank has connected before any runs the block: a block that fails on a first rank tears its
            # group down, and a peer still connecting to it would wait for it for the whole timeout.
            dist.barrier()
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        self._first = local_rank == 0
        if not self._first:
            dist.barrier()  # released by the first ranks' barrier in __exit__
        return self._first

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        if not _distributed():
            return False
        if exc_type is not None:
            # Abort: the peers wait in a barrier for this rank; closing its connections fails them now.
            dist.destroy_process_group()
            return False
        if self._first:
            dist.barrier()  # release the ranks waiting in __enter__
        if self._created_pg:
            dist.destroy_process_group()
        return False
