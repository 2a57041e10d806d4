"""An independently written distributed_utils with its own config classes (as upstream's module imports them from
nemo_automodel.components.distributed.config): dp_eval_sample_shard tells DDP apart by `isinstance` against its own
DDPConfig, which is not the suite's stand-in of that name.  The cases must hand it its own classes: it is right."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


@dataclass
class DDPConfig:
    find_unused_parameters: bool = False


@dataclass
class FSDP2Config:
    reshard_after_forward: bool = True


@dataclass
class MegatronFSDPConfig:
    overlap_grad_reduce: bool = True


def dp_eval_sample_shard(distributed_config, dp_rank: int, dp_size: int):
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
    if isinstance(distributed_config, DDPConfig) and dp_size > 1:
        return dp_rank, dp_size
    return None


export_real_module(globals(), "distributed_utils", DDPConfig=DDPConfig, FSDP2Config=FSDP2Config,
                   MegatronFSDPConfig=MegatronFSDPConfig, dp_eval_sample_shard=dp_eval_sample_shard)
