"""Shared by the broken fusion modules: the real fused GPTModel forward with another hidden-states -> log-probs
function (`make(fn)` gives the two seed functions that use it: the replacements a broken module exports with
tests/real_module.py). Not a module under test itself."""

from shardcheck.distributed_impl import _linear_ce_fusion as good


def make(hidden_states_to_logprobs):
    """(patch_gpt_model_forward_for_linear_ce_fusion, _gpt_forward_with_linear_ce_fusion) over `hidden_states_to_logprobs`."""

    def _gpt_forward_with_linear_ce_fusion(self, input_ids, position_ids, attention_mask, decoder_input=None,
                                           labels=None, inference_context=None, packed_seq_params=None,
                                           extra_block_kwargs=None, runtime_gather_output=None, *,
                                           inference_params=None, loss_mask=None, padding_mask=None,
                                           return_logprobs_for_linear_ce_fusion=False):
        if not return_logprobs_for_linear_ce_fusion:
            return good._original_forward()(
                self, input_ids, position_ids, attention_mask, decoder_input, labels, inference_context,
                packed_seq_params, extra_block_kwargs, runtime_gather_output,
                inference_params=inference_params, loss_mask=loss_mask, padding_mask=padding_mask)
        return good._fused_forward(
            self, input_ids, position_ids, attention_mask, decoder_input, labels, inference_context, packed_seq_params,
            extra_block_kwargs, runtime_gather_output, inference_params, loss_mask, padding_mask,
            hidden_states_to_logprobs)

    def patch_gpt_model_forward_for_linear_ce_fusion(*, chunk_size):
        good._install(_gpt_forward_with_linear_ce_fusion, chunk_size)

    return patch_gpt_model_forward_for_linear_ce_fusion, _gpt_forward_with_linear_ce_fusion
