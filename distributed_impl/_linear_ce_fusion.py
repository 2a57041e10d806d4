"""Linear + log-prob fusion for Megatron-Core's ``GPTModel``: the machinery behind the seed names
``patch_gpt_model_forward_for_linear_ce_fusion`` and ``_gpt_forward_with_linear_ce_fusion``, which
``shardcheck.distributed_impl.model_utils`` defines over its own ``from_parallel_hidden_states_to_logprobs``
(this module imports nothing of it).

``patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=c)`` replaces ``GPTModel.forward`` (the class attribute) by
``_gpt_forward_with_linear_ce_fusion``; a second call only updates ``c``. The patched forward, asked
``return_logprobs_for_linear_ce_fusion=True``, runs the embedding and the decoder as the original does, then returns
``[B, S-1]`` next-token log-probs ``log p(labels[:, t+1] | ...)`` computed ``c`` positions at a time from the decoder's
hidden states and the output weight (the tied embedding weight when embeddings are shared), vocab-parallel over the
model's TP group, through ``from_parallel_hidden_states_to_logprobs``: the ``[B, S, V]`` logits never exist, the
backward recomputes each chunk. Asked anything else, it calls the original forward with the same arguments.

In the terms of docs/ops/model_utils.md#megatron-core-gptmodel-fusion:
- ``labels`` is the *unshifted* ``[B, S]`` ids (like ``target`` of ``from_parallel_hidden_states_to_logprobs``); it is
  rolled by one inside. Missing: ``ValueError``. Ids outside ``[0, V)`` give 0 and a zero gradient.
- The result is in ``promote_types(model dtype, float32)``: float32 for bf16/fp16/fp32 models, float64 stays float64.
- ``loss_mask`` is **rejected** (``ValueError``): the result is per-token log-probs, not a loss, and masking belongs
  to the caller's loss (a masked position's log-prob is still returned; multiply by the mask afterwards).
- Context parallelism (CP > 1): ``ValueError``. TP > 1 needs sequence-parallel hidden states
  (``config.sequence_parallel``): ``ValueError`` otherwise. Multi-token prediction and an output-layer bias:
  ``ValueError``. A pipeline stage without the output layer (``post_process=False``) returns its hidden states, as
  the original forward does.

Megatron-Core is imported lazily: importing this module (or ``shardcheck.distributed_impl.model_utils``) never needs it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# The original GPTModel.forward, saved by the first patch; the chunk size of the last patch call.
_ORIGINAL_FORWARD: Optional[Callable] = None
_CHUNK_SIZE: Optional[int] = None


def _gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def _original_forward() -> Callable:
    """GPTModel's own forward, whether or not it has been patched."""
    if _ORIGINAL_FORWARD is not None:
        return _ORIGINAL_FORWARD
    return _gpt_model_class().forward


def _install(forward: Callable, chunk_size: int) -> None:
    """Set GPTModel.forward to `forward` (marked as a fusion forward), keeping the unpatched one once."""
    global _ORIGINAL_FORWARD, _CHUNK_SIZE
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    gpt = _gpt_model_class()
    if not getattr(gpt.forward, "_linear_ce_fusion", False):
        _ORIGINAL_FORWARD = gpt.forward
    _CHUNK_SIZE = chunk_size
    if gpt.forward is not forward:
        forward._linear_ce_fusion = True
        gpt.forward = forward


def _vocab_range(model: Any, weight: torch.Tensor, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """This TP rank's [start, end) of the vocab (Megatron splits it evenly and contiguously)."""
    vocab = int(model.vocab_size)
    if vocab % tp_size or weight.shape[0] != vocab // tp_size:
        raise ValueError(f"output weight {tuple(weight.shape)} is not a 1/{tp_size} vocab shard of V={vocab}")
    v_local = vocab // tp_size
    return tp_rank * v_local, (tp_rank + 1) * v_local


def _fused_forward(
    self: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoder_input: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    inference_context: Any,
    packed_seq_params: Any,
    extra_block_kwargs: Optional[dict],
    runtime_gather_output: Optional[bool],
    inference_params: Any,
    loss_mask: Optional[torch.Tensor],
    padding_mask: Optional[torch.Tensor],
    hidden_states_to_logprobs: Callable,
) -> torch.Tensor:
    """The fused path: embedding + decoder as in GPTModel.forward, then `hidden_states_to_logprobs` (with
    from_parallel_hidden_states_to_logprobs' signature) on the decoder output and the output weight."""
    from megatron.core.utils import deprecate_inference_params, get_pg_rank, get_pg_size

    if labels is None:
        raise ValueError("return_logprobs_for_linear_ce_fusion=True needs labels (the unshifted [B, S] ids)")
    if loss_mask is not None:
        raise ValueError(
            "loss_mask is not supported with return_logprobs_for_linear_ce_fusion=True: the result is "
            "per-token log-probs; apply the mask to them"
        )
    if _CHUNK_SIZE is None:
        raise ValueError("call patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=...) first")
    cp_size = max(get_pg_size(self.cp_group), int(getattr(self.config, "context_parallel_size", 1) or 1))
    if cp_size > 1:
        raise ValueError(f"linear-CE fusion does not support context parallelism (CP = {cp_size})")
    tp_group = self.tp_group
    tp_size = get_pg_size(tp_group)
    if tp_size > 1 and not self.config.sequence_parallel:
        raise ValueError(
            f"linear-CE fusion at TP = {tp_size} needs sequence-parallel hidden states (config.sequence_parallel=True)"
        )
    if self.mtp_process or getattr(self.config, "mtp_num_layers", None):
        raise ValueError("linear-CE fusion does not support multi-token prediction")

    inference_context = deprecate_inference_params(inference_context, inference_params)
    preproc_output = self._preprocess(
        input_ids=input_ids,
        position_ids=position_ids,
        decoder_input=decoder_input,
        inference_context=inference_context,
        packed_seq_params=packed_seq_params,
        padding_mask=padding_mask,
    )
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = preproc_output[
        :6
    ]
    rotary_pos_cos_sin = preproc_output[6] if len(preproc_output) == 7 else None
    hidden_states = self.decoder(
        hidden_states=decoder_input,
        attention_mask=attention_mask,
        inference_context=inference_context,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=rotary_pos_cos_sin,
        packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset,
        padding_mask=padding_mask,
        **(extra_block_kwargs or {}),
    )  # [S/TP, B, H] with sequence parallelism, else [S, B, H]
    if not self.post_process:
        return hidden_states

    output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    weight = output_weight if output_weight is not None else self.output_layer.weight
    if getattr(self.output_layer, "bias", None) is not None:
        raise ValueError("linear-CE fusion does not support an output-layer bias")
    expected_shape = (labels.shape[1] // tp_size, labels.shape[0])
    if labels.dim() != 2 or labels.shape[1] % tp_size or tuple(hidden_states.shape[:2]) != expected_shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} do not fit the decoder output {tuple(hidden_states.shape)} "
            f"(expected [S/TP, B, H] = [{labels.shape[1]}/{tp_size}, {labels.shape[0]}, H])"
        )
    vocab_start, vocab_end = _vocab_range(self, weight, tp_size, get_pg_rank(tp_group))
    return hidden_states_to_logprobs(
        hidden_states,
        self.output_layer,
        output_weight,
        runtime_gather_output,
        labels,
        vocab_start,
        vocab_end,
        tp_group,
        inference_only=not torch.is_grad_enabled(),
        cp_group=None,
        chunk_size=_CHUNK_SIZE,
    )
