"""BUG: the fused forward scores labels[:, t] at position t instead of the next token labels[:, t+1] (not rolled)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fusion_with, beside this module
from _fusion_with import make  # noqa: E402
from real_module import export_real_module  # noqa: E402


def _unrolled_logprobs(hidden, output_weight_layer, output_weight, runtime_gather_output, target, vocab_start_index,
                       vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None):
    weight = output_weight if output_weight is not None else output_weight_layer.weight
    logprobs = good.ChunkedDistributedHiddenStatesToLogprobs.apply(
        hidden, target, weight, vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only)
    return logprobs[:, :-1].contiguous()


patch_gpt_model_forward_for_linear_ce_fusion, _gpt_forward_with_linear_ce_fusion = make(_unrolled_logprobs)

export_real_module(globals(), "model_utils",
                   patch_gpt_model_forward_for_linear_ce_fusion=patch_gpt_model_forward_for_linear_ce_fusion,
                   _gpt_forward_with_linear_ce_fusion=_gpt_forward_with_linear_ce_fusion)
