"""verl#7493: fsdp_size=1 on several GPUs silently turns gradient synchronization off.

verl builds a 2-D (replicate, shard) device mesh and picks HYBRID_SHARD; with fsdp_size=1 the shard dim has size 1,
FSDP1 clamps the strategy to NO_SHARD and reduces the gradients over the size-1 shard group only, so the replicas
never synchronize (pytorch#154888, closed as not planned).  NEEDS HSDP (a data-parallel mesh of two dims: issue 38,
r-train).  The pair: the decoder on a (4, 1) replicate x shard mesh; broken: gradients reduced over the shard dim
only; fixed: over the replicate dim as well (verl PR #7494's fallback to a 1-D mesh)."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "verl_7493"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="verl-project/verl#7493",
    url="https://github.com/verl-project/verl/issues/7493",
    title="fsdp_size=1 degenerates HYBRID_SHARD to NO_SHARD with no reduction over the replicas",
    symptom="replicas train on their own data and drift apart; first seen in production on verl 0.8.0 "
    "(3 trainer + 1 rollout GPU)",
    time_to_find="reported 2026-08-20; fix PR #7494 the same day, closed unmerged ('a rare case')",
    fix="verl PR #7494 (closed): fall back to a 1-D FSDP mesh when the shard dim has size 1",
    topology="dp=4,cp=1,tp=1",
    names=("dparam",),
    related=("pytorch/pytorch#154888", "verl-project/verl#7494"),
    needs=Capability.HSDP,
)


def cases(quick: bool = False) -> list:
    return pending(BUG)
