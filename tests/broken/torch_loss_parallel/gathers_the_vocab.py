"""Bug: cross_entropy gathers the vocab-sharded logits and computes the loss on the full [N, V] logits on every rank:
right values and gradients, but each rank receives every other rank's piece of the logits."""

import sys
from pathlib import Path

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from real_module import export_real_module  # noqa: E402


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    target = target.full_tensor() if isinstance(target, DTensor) else target
    loss = F.cross_entropy(input.full_tensor(), target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return DTensor.from_local(loss, input.device_mesh, [Replicate()] * input.device_mesh.ndim, run_check=False)


export_real_module(globals(), "torch_loss_parallel",
                   source=ROOT / "examples" / "torch_loss_parallel" / "_torch_loss_parallel_ops.py")
