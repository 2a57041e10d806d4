"""torchtitan's FSDP gradient reduction on gloo: a plain SUM, not PREMUL_SUM(1.0).

torchtitan 0.3.0 turns FSDP2's gradient division off (`disable_fsdp_gradient_division`, torchtitan/distributed/
fsdp.py: `set_gradient_divide_factor(1.0)` on every FSDP module; its loss is each rank's token sum over the global
token count).  FSDP2 applies an explicit divide factor in float32 and bfloat16 through `ReduceOp.PREMUL_SUM(1 /
factor)`, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so a CPU run stops at the first backward.
Where the device is CPU, `install()` adds an import hook that wraps that function, once torchtitan's module is
imported: after it, every FSDP module also takes `set_force_sum_reduction_for_comms(True)`, FSDP2's SUM path, which
with the factor 1.0 torchtitan set divides by nothing: the same sum PREMUL_SUM(1.0) computes.  Nothing else of
torchtitan changes.
"""

from __future__ import annotations

import importlib.util

from shardcheck.harness.rank.shims.import_hook import after_import

NAME = "torchtitan's FSDP gradient reduction on gloo (SUM instead of PREMUL_SUM(1.0))"
MODULE = "torchtitan.distributed.fsdp"
CALLS = 0  # FSDP modules switched to the SUM path in this process


def wanted() -> bool:
    return importlib.util.find_spec("torchtitan") is not None


def _with_sum(disable):
    def disable_fsdp_gradient_division(model) -> None:
        global CALLS
        from torch.distributed.fsdp import FSDPModule

        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                CALLS += 1
                module.set_force_sum_reduction_for_comms(True)

    return disable_fsdp_gradient_division


def _patch(module) -> None:
    module.disable_fsdp_gradient_division = _with_sum(module.disable_fsdp_gradient_division)


def install() -> None:
    after_import(MODULE, _patch)
