"""paiml/entrenar#314 (and mosaicml/examples#11): a tied embedding whose weight gets the gradient of one use only.

With tie_word_embeddings the embedding and the LM head are one tensor and the optimizer must see the sum of both
uses' gradients; entrenar kept two copies (one updated with the LM head's gradient, one with the embedding's), and
mosaicml's GPT under FSDP was not tied at all.  Port, under TP 2: the decoder with its output projection tied to the
token embedding.  Broken: `parallelize_module` distributes the two modules' parameters separately, which unties them
(each copy then steps with its own use's gradient only); fixed: the tie restored after the plan (as torchtitan
does), so the one sharded weight gets both gradients."""

from __future__ import annotations

from _llama import model_case, tensor_parallel, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug
from shardcheck.reference.decoder import build

FAMILY = "entrenar_314"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="paiml/entrenar#314",
    url="https://github.com/paiml/entrenar/issues/314",
    title="tied embedding and LM head stepped with separate gradients (the tie lost)",
    symptom="validation perplexity 114.7 against PyTorch's 50 (a 2.3x gap); the two copies diverge after step 1",
    time_to_find="filed 2026-03-27 while chasing a persistent perplexity gap; closed",
    fix="accumulate the LM head's gradient into the embedding's before one optimizer step",
    topology="dp=1,cp=1,tp=2",
    names=("tok_embeddings.weight", "output.weight"),  # the tied weight, under either of its names
    related=("mosaicml/examples#11",),
)


def build_tied(cfg, gen):
    model = build(cfg, gen)
    model.output.weight = model.tok_embeddings.weight
    return model


def _untied_by_the_plan(model, ctx):
    tensor_parallel(model, ctx.mesh["tp"])
    return model


def _tie_restored(model, ctx):
    tensor_parallel(model, ctx.mesh["tp"])
    model.output.weight = model.tok_embeddings.weight  # both Shard(0) over the vocabulary on tp
    return model


parallelize = {BROKEN: _untied_by_the_plan, FIXED: _tie_restored}


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean()


def cases(quick: bool = False) -> list:
    return twins(
        BUG,
        lambda v, where: model_case(
            f"{FAMILY}.parallelize",
            v,
            where,
            lambda model, ctx: ctx.impl.parallelize[variant(ctx)](model, ctx),
            _loss,
            build_model=build_tied,
        ),
    )
