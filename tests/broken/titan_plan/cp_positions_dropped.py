"""BROKEN PLAN (a suite: --suite-path): torchtitan's Llama 3 under its whole parallelize_llama with context
parallelism, called without the positions its trainer hands the model under CP (`prepare_context_parallel_input`
shards them head-tail with the batch).  Each CP rank then rotates its tokens by the first positions of the RoPE
cache (0 .. S/cp - 1) instead of their global ones: rank 0 holds positions 0, 1, 6, 7 of 8 at cp 2 and rotates its
second chunk as 2, 3; rank 1 (positions 2 .. 5) is off everywhere.  Every module before the rotation is right, so
the run is one finding at cp 2: first diverging `layers.0.attention.rope`."""

from __future__ import annotations

import dataclasses

from shardcheck.suites.titan import case

FAMILY = "titan"


def _drop_positions(module, args, kwargs):
    return args[:1], {k: v for k, v in kwargs.items() if k != "positions"}


def positions_dropped(plan):
    def parallelize(model, ctx):
        model = plan(model, ctx)
        model.register_forward_pre_hook(_drop_positions, with_kwargs=True)  # the model called as model(tokens)
        return model

    return parallelize


def cases(quick: bool = False):
    good = case("llama3", False, True, case_id="llama3-cp-positions-dropped", context_parallel=True)
    return [dataclasses.replace(good, parallelize=positions_dropped(good.parallelize))]
