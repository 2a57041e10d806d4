"""shardcheck's API for writing cases: everything a suite imports, from one place.

A suite is a Python module (`suites/<name>.py` here, or any file given to `shardcheck run --suite-path`)
that defines:

    FAMILY: str                          the family its ops belong to; op ids are "FAMILY.Name", and Name
                                         must exist in the module under test
    cases(quick: bool) -> list[Case]     its correctness cases (quick: a smaller set, for `--quick`)
    bench_cases(quick: bool) -> list[Case]   optional: its benchmark cases, realistic sizes (`--bench`)
    fuzz_spaces() -> list[FuzzSpace]     optional: the parameter space of each op, for `shardcheck fuzz`
    IMPLEMENTATION: str                  optional: the default module under test of FAMILY when no
                                         `--impl FAMILY=...` is given: a dotted module name or a path to a
                                         .py file (relative to the suite file; `__file__` for a suite that
                                         holds its own implementation). Absent: shardcheck's own module of
                                         a built-in family.

The harness builds each case's full inputs (`make_inputs`, float64), the golden output and gradients from the
single-device `reference`, hands every rank its piece of the inputs, calls `run` with the module under test,
and compares every rank's outputs and input gradients with its piece of the golden.  The names:

    Case            one case of one op: inputs, the two calls, layouts, gradients, extra checks, where it runs
    Layout          how a full tensor maps to a rank's piece: one placement per mesh dim (dp, cp, tp)
    REPLICATED      Layout(): the full tensor on every rank
    Shard           torch's placement Shard(d): dim d split over a mesh dim (torch.chunk sizes)
    Replicate       torch's placement Replicate(): the same full tensor on every rank of a mesh dim
    Partial         torch's placement Partial(): the full value is the sum of the ranks' values (outputs)
    HeadTail        CP index rule: rank r of n holds chunks r and 2n-1-r of 2n (load-balanced causal attention)
    PackedHeadTail  CP index rule: HeadTail per packed sequence, boundaries from an input (cu_seqlens_padded)
    Permuted        CP index rule: an explicit permutation held in an input (seq_index)
    GradConvention  Case.grad_conventions: SUMMED (the sum of the ranks' upstream gradients) and/or OWN (each its own)
    GradSum         GradSum.apply(x, groups): identity whose backward sums the gradient over groups (DDP's role)
    Property        the result of one `property:<name>` check on one rank (Case.properties returns a list)
    PrecisionOnly   what an output check returns for the golden's values rounded exactly to a lower dtype: a warn
    BadInput        Case.bad_input: input outside the op's contract, judged "loud or right"
    Rule            where a check's rule comes from: Rule(RuleSource.SEED | RuleSource.OURS, cite) (Case.rule, .rules)
    RuleSource      seed (the seed says so) or ours (docs/ops/<family>.md#<section> fixes what the seed leaves open)
    seed            seed("quoted sentence"): a Rule the seed states
    ours            ours("docs/ops/x.md#section"): a Rule of ours, where the seed leaves the behaviour open
    OutsideSeed     Case.outside_seed: input the seed does not describe (everywhere, or at some topologies), judged
                    under a rule of ours there
    cite            cite(cases, rules, bad_input=rule): a suite's rules per check-name pattern, given to its cases
    batch_invariance  batch_invariance(run, inputs): Case.properties checking a row's result does not depend on
                    its place in the batch or on the other rows (permuted and split, bit for bit)
    BatchInvariance ModelCase.batch_invariance: the same property for a model case, every module's output per sample
    RankContext     what run / properties / comm / output checks get: mesh, groups, ranks, dtype, params, shapes
    Topology        (dp, cp, tp) sizes of a run; Case.supports(topology) limits where a case runs
    KnownFailure    Case.xfail: an expected failure with its reason and reference (xfail / xpass)
    FuzzSpace       fuzz_spaces() -> list[FuzzSpace]: where `shardcheck fuzz` draws an op's cases from
    MemoryModel     Case.memory: the per-rank peak memory expected from the shapes (`--bench` reports it)
    ModelCase       a model and its parallelization plan, checked module by module over one training step
                    (cases() may return it beside Cases; it is the Case its .case() builds)

docs/writing-a-suite.md is the guide, with a complete worked example.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The names load on first use (PEP 562), so that `import shardcheck.harness.core.options` -- what the CLI reads
# before torch is imported, to answer bad usage at once -- does not import torch through this package.
_SOURCES = {
    "Partial": "torch.distributed.tensor",
    "Replicate": "torch.distributed.tensor",
    "Shard": "torch.distributed.tensor",
    "Topology": "shardcheck.harness.core.topology",
    "ModelCase": "shardcheck.harness.core.model_case",
    **{name: "shardcheck.harness.core.case" for name in ("Case", "Property", "PrecisionOnly", "cite")},
    **{
        name: "shardcheck.harness.core.layout"
        for name in ("REPLICATED", "Layout", "HeadTail", "PackedHeadTail", "Permuted")
    },
    **{name: "shardcheck.harness.core.citations" for name in ("Rule", "RuleSource", "OutsideSeed", "seed", "ours")},
    "GradSum": "shardcheck.harness.core.grad_sum",
    "GradConvention": "shardcheck.harness.core.grad_convention",
    "BadInput": "shardcheck.harness.core.bad_input",
    "RankContext": "shardcheck.harness.core.rank_context",
    "KnownFailure": "shardcheck.harness.core.known_failure",
    "MemoryModel": "shardcheck.harness.core.memory_model",
    "FuzzSpace": "shardcheck.harness.core.fuzz_space",
    "batch_invariance": "shardcheck.harness.core.batch_invariance",
    "BatchInvariance": "shardcheck.harness.core.model_batch_invariance",
}

__all__ = [
    "Case",
    "Layout",
    "REPLICATED",
    "Shard",
    "Replicate",
    "Partial",
    "HeadTail",
    "PackedHeadTail",
    "Permuted",
    "GradSum",
    "GradConvention",
    "Property",
    "PrecisionOnly",
    "BadInput",
    "RankContext",
    "Topology",
    "KnownFailure",
    "FuzzSpace",
    "MemoryModel",
    "ModelCase",
    "Rule",
    "RuleSource",
    "OutsideSeed",
    "seed",
    "ours",
    "cite",
    "batch_invariance",
    "BatchInvariance",
]

if TYPE_CHECKING:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from shardcheck.harness.core.bad_input import BadInput
    from shardcheck.harness.core.batch_invariance import batch_invariance
    from shardcheck.harness.core.case import Case, PrecisionOnly, Property, cite
    from shardcheck.harness.core.citations import OutsideSeed, Rule, RuleSource, ours, seed
    from shardcheck.harness.core.fuzz_space import FuzzSpace
    from shardcheck.harness.core.grad_convention import GradConvention
    from shardcheck.harness.core.grad_sum import GradSum
    from shardcheck.harness.core.known_failure import KnownFailure
    from shardcheck.harness.core.layout import REPLICATED, HeadTail, Layout, PackedHeadTail, Permuted
    from shardcheck.harness.core.memory_model import MemoryModel
    from shardcheck.harness.core.model_batch_invariance import BatchInvariance
    from shardcheck.harness.core.model_case import ModelCase
    from shardcheck.harness.core.topology import Topology


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'shardcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
