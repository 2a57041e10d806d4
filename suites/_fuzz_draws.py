"""What the built-in suites' fuzz spaces draw (`fuzz_spaces()`, `shardcheck fuzz`): hypothesis strategies of the
topology, the dtype, sizes that divide over the drawn topology, and how logits are drawn.  Each op's space draws
its topology first, among the legal ones, then sizes that fit it, so every drawn dict is a case the op runs on.
Smallest first everywhere: hypothesis shrinks toward the first topology and the smallest sizes."""

from __future__ import annotations

from collections.abc import Callable

from shardcheck import Topology
from shardcheck.harness.core.fuzz_space import topology_params

DTYPES = ("float64", "float32", "bfloat16")


def st():
    """hypothesis.strategies, imported when a space is drawn from (suites load without hypothesis)."""
    from hypothesis import strategies

    return strategies


def topology(
    topologies: list[Topology],
    legal: Callable[[Topology], bool] = lambda t: True,
    cp: bool = False,
    expert_parallel: bool = False,
    hsdp: bool = False,
):
    """A legal topology among `topologies` (cp > 1 only when `cp`; ep > 1 only when `expert_parallel`, dp_replicate
    > 1 only when `hsdp`, as Case.runs_on), smallest first, as `topology_params` writes it ([dp, cp, tp], with ep
    and dp_replicate where either is > 1)."""

    def fits(t: Topology) -> bool:
        return (cp or t.cp == 1) and (expert_parallel or t.ep == 1) and (hsdp or t.dp_replicate == 1) and legal(t)

    ok = sorted(filter(fits, topologies), key=lambda t: (t.size, t.tp, t.cp, t.dp, t.ep, t.dp_replicate))
    return st().sampled_from([topology_params(t) for t in ok]) if ok else st().nothing()


def multiple_of(n: int, most: int, least: int = 1):
    """The multiples of n that are at least `least`, up to `most` multiples of n."""
    return st().integers(max(1, -(-least // n)), most).map(lambda m: m * n)


def chunk_or_none(most: int = 9):
    """A chunk size (1 .. most) or None (unchunked)."""
    return st().one_of(st().none(), st().integers(1, most))


def logits_draw():
    """Draw fields (suites._model_utils_inputs.Draw): the usual scale or huge logits, ties, a -inf fraction."""
    s = st()
    return s.fixed_dictionaries(
        {"scale": s.sampled_from([3.0, 300.0]), "ties": s.booleans(), "neg_inf": s.sampled_from([0.0, 0.2, 0.5])}
    )


def masked():
    """Fraction of targets outside [0, V) (-100, and a quarter as many V + 3)."""
    return st().sampled_from([0.0, 0.2, 0.5, 1.0])
