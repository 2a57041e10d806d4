"""BUG: dp_eval_sample_shard shards eval samples under every data-parallel config, FSDP2 and
Megatron-FSDP included (their ranks must score the same samples in lockstep)."""

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _barrier_with_timeout, _create_gloo_group  # noqa: F401  (private names: not in *)


def dp_eval_sample_shard(distributed_config, dp_rank, dp_size):
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size {dp_size})")
    return (dp_rank, dp_size) if dp_size > 1 else None
