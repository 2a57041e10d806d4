"""The built-in model suite: a small decoder (`shardcheck.reference.decoder`: embedding, RMSNorm, rotary attention over
SDPA with a causal mask, SwiGLU MLP, output projection) over one training step whose plan and loss
(`shardcheck.distributed_impl.decoder`) use the seed families as NeMo-RL and Automodel do: `cp_utils` shards the
batch and enters CP, `model_utils`' vocab-parallel log-probs make the loss over TP, `distributed_utils.reduce_loss`
reduces it over DP.  Each of those families is resolved by its own `--impl`, so

    shardcheck run --suite decoder --impl model_utils=their_model_utils.py

checks someone else's model_utils inside the step, and the finding names the first module (or the loss) where the
sharded step leaves the single-device one.  Every (dp, cp, tp) the default world sizes give; two layers, tiny dims.
Leave it out of a run with `--suite` naming the others (docs/model-cases.md).
"""

from __future__ import annotations

import torch

from shardcheck import HeadTail, Layout, ModelCase, Shard
from shardcheck.reference import decoder as ref

FAMILY = "decoder"
USES = ("cp_utils", "model_utils", "distributed_utils")

BATCH, SEQ = 4, 8  # BATCH: every DP size up to 4; SEQ: head-tail chunks of CP 4 (2·CP divides it)
CONFIG = ref.Config(vocab=32, dim=16, layers=2, heads=4, kv_heads=4, hidden=32)


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, CONFIG.vocab, (BATCH, SEQ), generator=gen)}


def _loss(logits: torch.Tensor, inputs: dict[str, torch.Tensor], ctx) -> torch.Tensor:
    if ctx is None:  # the single-device step
        return ref.loss(logits, inputs["tokens"])
    return ctx.impl.loss(logits, inputs["tokens"], ctx)


def _supports(t) -> bool:
    return (
        BATCH % t.dp == 0
        and SEQ % (2 * t.cp) == 0
        and CONFIG.kv_heads % t.tp == 0
        and CONFIG.vocab % t.tp == 0
        and CONFIG.hidden % t.tp == 0
    )


def cases(quick: bool = False) -> list[ModelCase]:
    return [
        ModelCase(
            op=f"{FAMILY}.parallelize",
            case_id="step",
            build=lambda gen: ref.build(CONFIG, gen),
            parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
            make_inputs=_make_inputs,
            model_inputs=("tokens",),
            loss=_loss,
            input_layouts={"tokens": Layout(dp=Shard(0))},  # whole sequences: cp_utils shards them inside the step
            batch_layout=Layout(dp=Shard(0), cp=HeadTail(1)),
            context_parallel=True,
            uses=USES,
            supports=_supports,
            params={"layers": CONFIG.layers},
        )
    ]
