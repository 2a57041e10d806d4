"""`GradConvention`: which gradient a case accepts for an output replicated over its `summed_over` dims, where each
rank's copy is its own summand of the loss and the seed does not fix how the backward treats those summands."""

from __future__ import annotations

from enum import StrEnum

from shardcheck.harness.core.records import Status, Symptom


class GradConvention(StrEnum):
    """How a backward treats the upstream gradients of an output every rank of a mesh dim holds (Case.summed_over)."""

    # The gradient of the sum of every rank's upstream gradient: the backward of an all-gather is a reduce-scatter
    # (Megatron's and our CP gathers).  The default.
    SUMMED = "summed"
    # Each rank's own upstream gradient at its own positions: DTensor's backward of a replicated output
    # (`DTensor.from_local(x, mesh, [Shard(1)]).full_tensor()`) takes the gradient as replicated and keeps its shard.
    OWN = "own"

    @property
    def words(self) -> str:
        if self == GradConvention.SUMMED:
            return "the sum of every rank's upstream gradient"
        return "each rank's own upstream gradient (DTensor's backward of a replicated output)"


def ranks_agree(per_rank: list[dict]) -> list[dict]:
    """`per_rank` with passes under different conventions turned into failures: one implementation follows one
    convention on every rank, so ranks that pass under two are a gradient right on some ranks by chance of
    convention (a sum on some ranks, not on others)."""
    conventions = {r.get("grad_convention") for r in per_rank if r["status"] == Status.PASS} - {None}
    if len(conventions) < 2:
        return per_rank
    named = ", ".join(f"rank {r['rank']} {r.get('grad_convention')}" for r in sorted(per_rank, key=lambda r: r["rank"]))
    message = f"ranks follow different gradient conventions ({named}): one implementation follows one"
    return [
        {**r, "status": Status.FAIL, "symptom": Symptom.VALUES, "message": message} if r["status"] == Status.PASS else r
        for r in per_rank
    ]
