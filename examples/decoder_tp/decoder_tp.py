"""shardcheck suite of a model: a small decoder (`_decoder.py`) under a torchtitan-style plan over every mesh dim
(`_decoder_plan.py`, the module under test: TP + sequence parallelism over tp, torch's context_parallel over cp,
FSDP2 over dp x cp), checked module by module over one training step against the same decoder on one device.

    shardcheck run --suite-path examples/decoder_tp

A `ModelCase` per configuration: multi-head attention (every TP degree), grouped key/value heads (2 of them: TP 2
splits them, TP 4 keeps them whole and each rank takes the one its query heads use), and a vocabulary (31) TP does
not divide.  The batch is laid out as the plan's ranks hold it: split over dp, in torch's head-tail
load-balanced layout over cp (what context_parallel's sharder gives); each rank's loss is its summand of the mean.
Any failing step is one finding naming the first module where the sharded model leaves the single-device one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _decoder import Config, build
from torch.distributed.tensor import Partial, Shard

from shardcheck import HeadTail, Layout, ModelCase

FAMILY = "decoder_tp"
IMPLEMENTATION = "_decoder_plan.py"

BATCH, SEQ = 4, 8  # dp 4 holds a sequence each; cp 4 two chunks of 1 (head-tail: SEQ % 2·cp == 0)
BATCH_LAYOUT = Layout(dp=Shard(0), cp=HeadTail(1))


def _inputs(cfg: Config):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=gen)
        return {"tokens": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}

    return make


def loss(logits, inputs, ctx) -> torch.Tensor:
    """Mean next-token cross-entropy; on a rank, the plan's own loss (its summand of the mean)."""
    if ctx is not None:
        return ctx.impl.loss(logits, inputs, ctx)
    return F.cross_entropy(
        logits.flatten(0, 1).float() if logits.dtype == torch.bfloat16 else logits.flatten(0, 1),
        inputs["targets"].flatten(),
    )


def _supports(cfg: Config):
    def fits(t) -> bool:
        # kv_heads < tp: as many key/value heads as TP splits the query heads into, or a whole number of them
        heads = cfg.heads % t.tp == 0 and (cfg.kv_heads % t.tp == 0 or t.tp % cfg.kv_heads == 0)
        return heads and BATCH % t.dp == 0 and SEQ % (2 * t.cp) == 0 and (SEQ // t.cp) % t.tp == 0

    return fits


def model_case(case_id: str, cfg: Config) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id,
        build=lambda gen: build(cfg, gen),
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=_inputs(cfg),
        model_inputs=("tokens",),
        loss=loss,
        input_layouts={"tokens": BATCH_LAYOUT, "targets": BATCH_LAYOUT},
        loss_layout=Layout(dp=Partial(), cp=Partial()),
        context_parallel=True,
        supports=_supports(cfg),
        params={"kv_heads": cfg.kv_heads, "layers": cfg.layers},
    )


def cases(quick: bool = False) -> list[ModelCase]:
    # odd-vocab: a vocabulary TP does not divide (torch's uneven shards of the embedding and the output projection)
    return [
        model_case("mha", Config()),
        model_case("gqa", Config(kv_heads=2)),
        model_case("odd-vocab", Config(vocab=31)),
    ]
