"""Bug: the vocab-parallel log-softmax helper every log-prob op calls raises over more than one TP rank, so
each of those ops raises the same exception at the same line."""

import importlib.util
from pathlib import Path

import torch.distributed as dist

# A private copy of the real module whose helper is replaced: its ops look the helper up at call time.
_spec = importlib.util.spec_from_file_location(
    "_model_utils_shared_helper_raises", Path(__file__).resolve().parents[3] / "distributed_impl" / "model_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)


def _compute_distributed_log_softmax(vocab_parallel_logits, group):
    if dist.get_world_size(group) > 1:
        raise ValueError(f"log-softmax over {dist.get_world_size(group)} vocab shards of "
                         f"{vocab_parallel_logits.shape[-1]} is not supported")
    return _original(vocab_parallel_logits, group)


_original = _m._compute_distributed_log_softmax
_m._compute_distributed_log_softmax = _compute_distributed_log_softmax
globals().update({name: value for name, value in vars(_m).items()
                  if not name.startswith("__") and name != "_compute_distributed_log_softmax"})
