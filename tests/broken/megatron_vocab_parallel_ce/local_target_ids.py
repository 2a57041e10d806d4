"""Bug: the wrapper hands Megatron this rank's local token ids (target − the piece's start), as a caller who thinks
the op wants ids within its piece would: right at TP 1, wrong losses and gradients at TP ≥ 2."""

import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "megatron_vocab_parallel_ce"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(EXAMPLE))
import _megatron_ce as good  # noqa: E402
from real_module import export_real_module  # noqa: E402


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    start = dist.get_rank(tp_group) * vocab_parallel_logits.shape[-1]
    return good.vocab_parallel_cross_entropy(vocab_parallel_logits, target - start, label_smoothing, tp_group)


export_real_module(globals(), "megatron_vocab_parallel_ce", source=EXAMPLE / "_megatron_ce.py")
