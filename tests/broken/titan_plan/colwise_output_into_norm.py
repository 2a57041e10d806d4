"""BROKEN PLAN (a suite: --suite-path): torchtitan's Llama 3 under TP (no sequence parallelism) whose first block's
`feed_forward.w2` is sharded as a ColwiseParallel layer (weight Shard(0): its output left Shard(-1), each rank
holding a slice of the hidden dim) instead of RowwiseParallel (output all-reduced).  The block's output stays split
on the hidden dim into the next norm, `layers.1.attention_norm`, whose mean over the hidden dim is then a partial
result (`Partial(avg)`): torchtitan's DTensor backend refuses the norm's in-place `+ eps` on it, so the plan is one
error at TP >= 2 (not a silent divergence: under a DTensor backend the mistake cannot compute)."""

from __future__ import annotations

from shardcheck.suites.titan import case

FAMILY = "titan"


def w2_colwise(config) -> None:
    from torchtitan.models.common.decoder_sharding import colwise_config

    config.layers[0].feed_forward.w2.sharding_config = colwise_config()


def cases(quick: bool = False):
    return [case("llama3", False, False, case_id="llama3-tp-w2-colwise", edit=w2_colwise)]
