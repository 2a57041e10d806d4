"""Routers with a margin for the third-party MoE models (suites/_hf_models.py, suites/_titan_models.py).

A router's top-k is a discrete choice: two correct runs that round differently (a sharded step and the single-device
one, in bfloat16) could send a token to different experts, and every tensor after it would differ without a defect.
`widen_routing` redraws each router until every token of the case's own inputs routes with reference/moe.py's margin
(the k-th router logit MIN_MARGIN above the (k+1)-th), so no dtype flips a route.  The model's `build(gen)` calls it
with the tokens `make_inputs(gen)` draws next (`peek`): the same generator, read without being advanced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardcheck.reference.moe import MIN_MARGIN, routing_margin

__all__ = ["MIN_MARGIN", "routing_margin", "peek", "router_input", "widen_routing"]


def peek(gen: torch.Generator) -> torch.Generator:
    """A copy of `gen` at its current state: what it draws next, drawn without advancing `gen`."""
    copy = torch.Generator()
    copy.set_state(gen.get_state())
    return copy


def router_input(run: Callable[[], object], gate: torch.nn.Module) -> torch.Tensor:
    """What `gate` sees when `run()` runs the model: [tokens, hidden]."""
    seen = []
    hook = gate.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def widen_routing(run: Callable[[], object], gates: list[torch.nn.Module], top_k: int, gen: torch.Generator) -> None:
    """Each gate's weight ([experts, hidden]: logits = x @ weight.T) redrawn from `gen`, first layer first, until every
    token `run()` routes has a margin of MIN_MARGIN.  Weights ~6/sqrt(hidden), as reference/moe.py's."""
    for gate in gates:
        x = router_input(run, gate)
        with torch.no_grad():
            for _ in range(1000):
                if routing_margin(x @ gate.weight.detach().T, top_k) >= MIN_MARGIN:
                    break
                noise = torch.randn(gate.weight.shape, generator=gen, dtype=torch.float64)
                gate.weight.copy_(noise * 6 / x.shape[-1] ** 0.5)
            else:
                raise ValueError(f"no router of margin {MIN_MARGIN} in 1000 draws")
