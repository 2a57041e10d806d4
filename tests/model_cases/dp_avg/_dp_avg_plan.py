"""The plan under test of suite dp_avg: data parallelism in the averaged convention, as most training code writes it.
Each DP rank's loss is the mean over its own rows (`loss`), and the gradients are averaged over the DP group by the
wrapper the case names (`ctx.params["wrapper"]`): FSDP2's `fully_shard` with its default (an average; over dp, over
dp x cp with the tokens split over cp too, or HSDP on the data mesh replicate x shard), DDP (also under
`torch.compile`), or FSDP1 (`use_orig_params=True`, each block wrapped)."""

from __future__ import annotations

import torch
from _dp_avg_model import mean_loss
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel


def loss(out: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """Each DP rank's loss: the mean over its own rows (declared `loss_layout=Layout(dp=Partial("avg"))`)."""
    return mean_loss(out, inputs)


def fsdp2(model: nn.Module, ctx) -> nn.Module:
    """`fully_shard` per block and at the root, its default reduction: the gradients averaged over dp."""
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    model.set_force_sum_reduction_for_comms(True)  # gloo has no AVG: FSDP2 sums and divides by dp itself
    return model


def fsdp2_cp(model: nn.Module, ctx) -> nn.Module:
    """`fully_shard` over dp x cp flattened: the gradients averaged over both, each rank's loss its own tokens' mean
    (torchtitan's convention; declared `Layout(dp=Partial("avg"), cp=Partial("avg"))`)."""
    mesh = ctx.mesh["dp", "cp"]._flatten("dp_cp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    return model


def hsdp(model: nn.Module, ctx) -> nn.Module:
    """HSDP: `fully_shard` on the 2-D data mesh (replicated over "dp_replicate", sharded over "dp_shard"), its default:
    the gradients reduce-scattered over the shard group, all-reduced over the replicate group, averaged over both."""
    mesh = ctx.data_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    return model


def ddp(model: nn.Module, ctx) -> nn.Module:
    return DistributedDataParallel(model, process_group=ctx.group("dp"))


def fsdp1(model: nn.Module, ctx) -> nn.Module:
    """FSDP1, each block its own unit; its parameters keep their names under `_fsdp_wrapped_module.`."""
    return FullyShardedDataParallel(
        model,
        process_group=ctx.group("dp"),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
    )


def compiled(model: nn.Module, ctx) -> nn.Module:
    """DDP under `torch.compile` (the eager backend: dynamo's graphs, no code generation): names under `_orig_mod.`."""
    return torch.compile(ddp(model, ctx), backend="eager")


WRAPPERS = {"fsdp2": fsdp2, "fsdp2-cp": fsdp2_cp, "hsdp": hsdp, "ddp": ddp, "fsdp1": fsdp1, "compiled": compiled}


def parallelize(model: nn.Module, ctx) -> nn.Module:
    if ctx.size("dp") * ctx.size("cp") == 1 and ctx.params["wrapper"] not in ("fsdp1", "compiled"):
        return model
    return WRAPPERS[ctx.params["wrapper"]](model, ctx)
