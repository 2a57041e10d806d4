"""BROKEN PLAN (a suite: --suite-path): torchtitan's Llama 3 under its whole parallelize_llama (FSDP2 over dp), whose
last FSDP unit (`norm` and `lm_head`, wrapped together) gets FSDP2's gradient division back, a divide factor of dp:
the gradients of `norm.weight` and `lm_head.weight` are averaged over dp while each rank's loss is torchtitan's
summand of the global mean (its token sum over the global token count), so they come out dp times too small.  The
kind of mistake a unit wrapped, or re-configured, after `disable_fsdp_gradient_division` makes.  One finding at dp
>= 2: first diverging `norm.weight`'s gradient (half the true one at dp 2), the wrong parameters norm.weight and
lm_head.weight; every activation passes."""

from __future__ import annotations

import dataclasses

from shardcheck.suites.titan import case

FAMILY = "titan"


def head_averaged(plan):
    def parallelize(model, ctx):
        model = plan(model, ctx)
        model.lm_head.set_gradient_divide_factor(float(ctx.size("dp")))  # the unit of norm and lm_head
        return model

    return parallelize


def cases(quick: bool = False):
    good = case("llama3", False, True, case_id="llama3-fsdp-head-averaged", fsdp=True)
    return [dataclasses.replace(good, parallelize=head_averaged(good.parallelize))]
