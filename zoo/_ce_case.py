"""The op case the zoo's vocab-parallel cross-entropy bugs share: logits [B, S, V] split over the vocabulary on
`tp`, integer targets, the per-token loss (the same on every TP rank) and the gradient of the logits checked."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardcheck import Case, Layout, Shard

BATCH, SEQ = 2, 3


def ce_case(
    op: str,
    variant: str,
    where: dict,
    vocab: int,
    reference: Callable,
    run: Callable,
    ignored: bool = False,
    target_vocab: int | None = None,
) -> Case:
    """`reference(full inputs)` and `run(impl, ctx, local inputs)` give the per-token loss; `ignored`: a third of
    the targets are -100 (not counted), as a masked-language model's labels are; `target_vocab`: targets below it
    only (the real vocabulary of padded logits)."""

    def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
        logits = 2 * torch.randn(BATCH, SEQ, vocab, generator=gen, dtype=torch.float64)
        target = torch.randint(0, target_vocab or vocab, (BATCH, SEQ), generator=gen)
        if ignored:
            target[torch.rand(BATCH, SEQ, generator=gen) < 0.34] = -100
        return {"logits": logits, "target": target}

    return Case(
        op=op,
        case_id=variant,
        make_inputs=make_inputs,
        reference=reference,
        run=run,
        input_layouts={"logits": Layout(tp=Shard(-1))},
        output_names=("loss",),
        grad_inputs=("logits",),
        dtypes=where["dtypes"],
        supports=where["supports"],
        params=where["params"],
    )
