"""shardcheck suite of a model: a small decoder (`_decoder.py`) under a torchtitan-style tensor-parallel plan with
sequence parallelism (`_decoder_plan.py`, the module under test), checked module by module over one training step
against the same decoder on one device.

    shardcheck run --suite-path examples/decoder_tp

A `ModelCase` per configuration: multi-head attention (every TP degree) and grouped key/value heads (TP up to the
number of key/value heads).  Any failing step is one finding naming the first module where the sharded model leaves
the single-device one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardcheck import ModelCase
from _decoder import Config, build

FAMILY = "decoder_tp"
IMPLEMENTATION = "_decoder_plan.py"

BATCH, SEQ = 2, 8


def _inputs(cfg: Config):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=gen)
        return {"tokens": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    return make


def loss(logits, inputs, ctx) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float() if logits.dtype == torch.bfloat16 else logits.flatten(0, 1),
                           inputs["targets"].flatten())


def model_case(case_id: str, cfg: Config) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize", case_id=case_id,
        build=lambda gen: build(cfg, gen),
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=_inputs(cfg), model_inputs=("tokens",), loss=loss,
        supports=lambda t: t.dp == 1 and t.cp == 1 and cfg.kv_heads % t.tp == 0 and cfg.vocab % t.tp == 0,
        params={"kv_heads": cfg.kv_heads, "layers": cfg.layers})


def cases(quick: bool = False) -> list[ModelCase]:
    return [model_case("mha", Config()), model_case("gqa", Config(kv_heads=2))]
