"""pytorch#155903: `set_reduce_scatter_divide_factor` is inconsistent between FSDP and HSDP.

FSDP2 on a 2-D (replicate x shard) mesh applied the custom divide factor to the reduce-scatter over the shard dim
and then still averaged over the replicate dim, so HSDP's gradients came out replicate-size times smaller than the
same model's under FSDP on the flattened mesh with the same factor.  NEEDS HSDP: a data-parallel mesh of two dims
(issue 38, r-train).  The pair, once it exists: the decoder under fully_shard on a (2, 2) dp mesh with divide
factor N; broken: the replicate-dim average on top (`_hsdp_broken`); fixed: the factor the whole reduction's
(`_hsdp_fixed`)."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "pytorch_155903"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="pytorch/pytorch#155903",
    url="https://github.com/pytorch/pytorch/issues/155903",
    title="HSDP applies the reduce-scatter divide factor and then averages over the replicate dim too",
    symptom="the same model and factor give different gradients under FSDP (1-D mesh) and HSDP (2-D mesh)",
    time_to_find="reported with a repro 2025-06-13; closed",
    fix="closed in pytorch (the divide factor applied to the whole HSDP reduction)",
    topology="dp=4,cp=1,tp=1",
    names=("dparam",),
    needs=Capability.HSDP,
)


def _hsdp_broken(grad_sum, factor: float, replicate: int):
    return grad_sum / factor / replicate


def _hsdp_fixed(grad_sum, factor: float, replicate: int):
    return grad_sum / factor


def cases(quick: bool = False) -> list:
    return pending(BUG)
