"""BUG: dp_eval_sample_shard shards eval samples under every data-parallel config, FSDP2 and
Megatron-FSDP included (their ranks must score the same samples in lockstep)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def dp_eval_sample_shard(distributed_config, dp_rank, dp_size):
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size {dp_size})")
    return (dp_rank, dp_size) if dp_size > 1 else None


export_real_module(globals(), "distributed_utils", dp_eval_sample_shard=dp_eval_sample_shard)
