"""huggingface/transformers#34191 (October 2024): gradient accumulation normalized each micro-batch's loss by its
own token count.

(x1 / n1 + x2 / n2) / 2 is not (x1 + x2) / (n1 + n2): with accumulation the Trainer's default causal-LM loss took
each micro-batch's mean and averaged them, so runs with and without accumulation had different losses and
gradients whenever the micro-batches' valid-token counts differed.  NEEDS micro-batches in the model step (issue 38,
r-steps).  The pair: two micro-batches of unequal padding; broken: `_mean_per_micro_batch`; fixed:
`_sum_over_all_tokens` (the fix's num_items_in_batch)."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "transformers_34191"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="huggingface/transformers#34191",
    url="https://github.com/huggingface/transformers/pull/34191",
    title="gradient accumulation averages per-micro-batch mean losses",
    symptom="losses did not match between runs with accumulation toggled on and off (the HF blog 'Fixing "
    "Gradient Accumulation', 2024-10-16); follow-ups #35210, #35438, #37766 for num_items_in_batch",
    time_to_find="the field found it in October 2024 after years of accumulation in the Trainer; fixes "
    "continued into 2025",
    fix="huggingface/transformers PR #34191 (num_items_in_batch)",
    topology="dp=1,cp=1,tp=1",
    names=("the loss",),
    related=("meta-pytorch/torchtune#1875", "huggingface/transformers#35438"),
    needs=Capability.MICRO_BATCHES,
)


def _mean_per_micro_batch(token_loss_sums, token_counts):
    return sum(s / n for s, n in zip(token_loss_sums, token_counts)) / len(token_counts)


def _sum_over_all_tokens(token_loss_sums, token_counts):
    return sum(token_loss_sums) / sum(token_counts)


def cases(quick: bool = False) -> list:
    return pending(BUG)
