"""An independently written model_utils whose Megatron fusion patch keeps its own "already patched" flag, as
NeMo-RL-style code does: a second call only updates the chunk size.  Correct; shardcheck must undo the flag with
the class after each case, or the next case's patch call is a no-op on the restored GPTModel (an unexpected keyword
`return_logprobs_for_linear_ce_fusion`)."""

from __future__ import annotations

import sys
from pathlib import Path

from shardcheck.distributed_impl import _linear_ce_fusion as fusion

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402

_GPT_FORWARD_PATCHED = False
_FUSION_CHUNK_SIZE = None


def patch_gpt_model_forward_for_linear_ce_fusion(*, chunk_size: int) -> None:
    global _GPT_FORWARD_PATCHED, _FUSION_CHUNK_SIZE
    if _GPT_FORWARD_PATCHED:  # patched already: only the chunk size changes
        fusion._CHUNK_SIZE = _FUSION_CHUNK_SIZE = chunk_size
        return
    from megatron.core.models.gpt.gpt_model import GPTModel

    fusion._ORIGINAL_FORWARD = GPTModel.forward
    fusion._CHUNK_SIZE = _FUSION_CHUNK_SIZE = chunk_size
    GPTModel.forward = _gpt_forward_with_linear_ce_fusion  # noqa: F821 (the real module's, exported below)
    _GPT_FORWARD_PATCHED = True


export_real_module(globals(), "model_utils",
                   patch_gpt_model_forward_for_linear_ce_fusion=patch_gpt_model_forward_for_linear_ce_fusion)
