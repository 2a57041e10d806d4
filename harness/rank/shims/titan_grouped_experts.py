"""torchtitan's grouped experts on CPU: one matmul per expert, in the input's dtype.

torchtitan 0.3.0's `GroupedExperts.forward` (torchtitan/models/common/moe.py) casts the tokens and the expert weights
to bfloat16 and calls `torch._grouped_mm`, a CUDA kernel: on CPU it refuses float64 and row strides that are not
multiples of 16 bytes, and it would compute a float64 or float32 step in bfloat16.  Where the device is CPU,
`install()` adds an import hook that replaces that forward, once torchtitan's module is imported, by the same
computation written per expert: for expert e, its rows `x_e` (the tokens are grouped by expert,
`num_tokens_per_expert` rows each) give `(silu(x_e @ w1_e.T) * (x_e @ w3_e.T)) @ w2_e.T`, in `x`'s dtype.  The
dispatch, the routing and every collective stay torchtitan's.
"""

from __future__ import annotations

import importlib.util

from shardcheck.harness.rank.shims.import_hook import after_import

NAME = "torchtitan's grouped-experts matmul (a loop over experts in the input dtype)"
MODULE = "torchtitan.models.common.moe"
CALLS = 0  # expert forwards the loop ran in this process


def wanted() -> bool:
    return importlib.util.find_spec("torchtitan") is not None


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def forward(self, x_RD, num_tokens_per_expert_E):
    """GroupedExperts.forward as a loop over the local experts, in x's dtype."""
    global CALLS
    import torch
    import torch.nn.functional as F

    CALLS += 1
    w1, w2, w3 = (_local(w).to(x_RD.dtype) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    counts = [int(n) for n in num_tokens_per_expert_E.tolist()]
    outs = []
    for e, rows in enumerate(torch.split(x_RD, counts, dim=0)):
        outs.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
    return torch.cat(outs, dim=0) if outs else x_RD.new_zeros(0, w2.shape[1])


def _patch(module) -> None:
    module.GroupedExperts.forward = forward


def install() -> None:
    after_import(MODULE, _patch)
