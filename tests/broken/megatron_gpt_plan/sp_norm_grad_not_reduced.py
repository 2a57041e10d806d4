"""BROKEN PLAN (a suite: --suite-path): Megatron-Core's GPTModel under TP with sequence parallelism, without
finalize_model_grads' all-reduce of the sequence-parallel-tagged gradients.  Each TP rank's norm weights and
row-parallel biases see only their own sequence shard, so their gradients hold only that shard's part and the SGD
step moves each rank's replica differently.  The forward and every activation gradient are right; the first
divergence is decoder.layers.0.input_layernorm.weight's gradient, then its value after the step."""

from __future__ import annotations

from shardcheck.suites._model_utils_megatron_gpt import gpt_model_case

FAMILY = "model_utils"


def cases(quick: bool = False):
    return [gpt_model_case(tied=False, sync_sp_grads=False, case_id="model-untied-sp-grads-not-reduced")]
