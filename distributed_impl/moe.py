"""A mixture-of-experts layer over expert parallelism (ep, a part of dp) and expert tensor parallelism (tp), dropless,
as Megatron-Core's all-to-all token dispatcher and torchtitan's MoE write it:

- `route`, `aux_loss`: the router's top-k (softmax, top-k, renormalized) and the load-balancing loss, whose token
  fractions f_e are counted over the whole data-parallel batch (`group`: dp) and whose P_e is this rank's summand.
- `dispatch`: this rank's (token, slot) rows grouped by expert and exchanged over the ep group by
  `all_to_all_single` with uneven splits; each rank receives the rows of its E/ep experts, grouped by expert, then by
  source rank, tokens in order (`Routing` remembers how, for `combine`).
- `combine`: the rows back by the reverse all-to-all, un-permuted to (token, slot) and weighted by the routing
  weights.
- `expert_mlp`: this rank's experts on their rows; under expert-TP each expert's hidden dim is split over tp and the
  outputs summed over tp (Megatron's copy-to / reduce-from tensor-parallel region).
- `parallelize(model, ctx)`: the plan of the MoE decoder (reference/moe.py): experts sharded over ep (and tp),
  dense weights replicated; each rank's loss is its summand of the whole batch's, so the dense gradients are summed
  over dp and the experts' over their expert-data-parallel group (edp) alone: the ranks holding the same experts
  (each expert already saw, through the all-to-all, the tokens of every dp rank of its ep group).
- `loss(outputs, tokens, ctx)`: the mean next-token NLL plus the aux loss, its value the whole batch's on every rank,
  its gradient this rank's summand (its rows' mean over dp).
Contract: docs/ops/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math in float32 at least (docs/ops/README.md): float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], experts [T, k]) of router logits [T, E]: softmax in float32 at least, top-k, renormalized."""
    probs = torch.softmax(logits.to(math_dtype(logits.dtype)), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts


def aux_loss(
    logits: torch.Tensor, experts: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's summand of E * sum_e f_e * P_e over the batch split over `group` (the data-parallel ranks): f_e
    counted over the whole batch (all-reduced, no gradient), P_e this rank's probabilities summed over the whole
    batch's token count.  The sum over `group` is the whole batch's loss."""
    probs = torch.softmax(logits.to(math_dtype(logits.dtype)), dim=-1)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    tokens = torch.tensor([float(logits.shape[0])], dtype=probs.dtype, device=probs.device)
    stats = torch.cat([counts, tokens])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    counts, total = stats[:-1], stats[-1]
    fraction = counts / (total * experts.shape[-1])
    return (num_experts * (fraction * probs.sum(0) / total).sum()).to(logits.dtype)


@dataclass
class Routing:
    """How `dispatch` moved this rank's rows, for `combine` to move them back."""

    order: torch.Tensor  # this rank's (token, slot) rows sorted by expert: row i sent is flat row order[i]
    regroup: torch.Tensor  # received rows (by source rank, then expert) sorted by local expert
    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank
    counts: list[int]  # rows of each local expert, after regrouping
    top_k: int
    group: dist.ProcessGroup | None  # the ep group the rows went over


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """`rows` split by `in_splits` to the ranks of `group`, theirs received by `out_splits` (differentiable)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


def dispatch(
    x: torch.Tensor, experts: torch.Tensor, num_experts: int, ep_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, Routing]:
    """(rows of this rank's experts, Routing) of tokens x [T, D] routed to experts [T, k] over the ep group."""
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    local = num_experts // ep
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sent = x[order // experts.shape[-1]]
    counts = torch.bincount(flat, minlength=num_experts)
    received = counts.clone()
    if ep > 1:  # each rank's count of rows for each of my experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=ep_group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = received.view(ep, local).sum(1).tolist()
    rows = _exchange(sent, recv_splits, send_splits, ep_group)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.to(x.device))
    regroup = torch.argsort(expert_of_row, stable=True)
    routing = Routing(
        order=order,
        regroup=regroup,
        send_splits=send_splits,
        recv_splits=recv_splits,
        counts=received.view(ep, local).sum(0).tolist(),
        top_k=experts.shape[-1],
        group=ep_group,
    )
    return rows[regroup], routing


def unpermute(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows `rows[i]` put back at position index[i] (the inverse of taking rows[index])."""
    return torch.zeros_like(rows).index_copy(0, index, rows)


def combine(rows: torch.Tensor, routing: Routing, weights: torch.Tensor) -> torch.Tensor:
    """[T, D]: the experts' output rows (in dispatch's order) back to their tokens, weighted."""
    by_source = unpermute(rows, routing.regroup)
    back = _exchange(by_source, routing.send_splits, routing.recv_splits, routing.group)
    slots = unpermute(back, routing.order).view(weights.shape[0], routing.top_k, -1)
    return (slots * weights[..., None].to(slots.dtype)).sum(1)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient summed over tp (each tp rank's experts hold part of the hidden dim)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """The tp ranks' partial outputs summed; the gradient passed through (every tp rank needs the whole one)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def expert_mlp(
    rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Rows grouped by local expert (counts[e] each) through experts w1 [E/ep, D, H/tp], w2 [E/ep, H/tp, D]."""
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    if tp:
        rows = _CopyToTP.apply(rows, tp_group)
    out = torch.cat([F.silu(p @ w1[e]) @ w2[e] for e, p in enumerate(rows.split(counts))])
    return _ReduceFromTP.apply(out, tp_group) if tp else out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: an expert weight may be a plain tensor or a DTensor on the ep (x tp) mesh."""
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelMoE(nn.Module):
    """The reference MoE's forward over ep and tp: its parameters (names kept) hold this rank's experts; `dispatch`
    and `combine` are this module's."""

    def __init__(self, moe: nn.Module, ctx):
        super().__init__()
        self.cfg = moe.cfg
        self.router, self.experts, self.shared = moe.router, moe.experts, moe.shared
        self.ctx = ctx
        self.aux: torch.Tensor | None = None

    @staticmethod
    def combine(rows: torch.Tensor, routing: Routing, weights: torch.Tensor) -> torch.Tensor:
        return combine(rows, routing, weights)

    def aux_group(self) -> dist.ProcessGroup:
        """The group the load-balancing loss counts its tokens over: the whole data-parallel batch."""
        return self.ctx.group("dp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        ctx, cfg = self.ctx, self.cfg
        tokens = x.reshape(-1, d)
        logits = self.router(x).reshape(-1, cfg.experts)
        weights, experts = route(logits, cfg.top_k)
        # this rank's summand of the whole batch's load-balancing loss (docs/ops/moe.md#aux-loss)
        self.aux = aux_loss(logits, experts, cfg.experts, self.aux_group())
        rows, routing = dispatch(tokens, experts, cfg.experts, ctx.group("ep"))
        tp_group = ctx.group("tp") if ctx.size("tp") > 1 else None
        w1, w2 = _local(self.experts.w1), _local(self.experts.w2)
        y = expert_mlp(rows, routing.counts, w1, w2, tp_group)
        out = self.combine(y, routing, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, d)


def shard_experts(experts: nn.Module, ctx) -> None:
    """w1 [E, D, H] and w2 [E, H, D] cut to this rank's E/ep experts and H/tp hidden units (the harness fills them)."""
    ep, tp = ctx.size("ep"), ctx.size("tp")
    e_local = experts.w1.shape[0] // ep
    h_local = experts.w1.shape[2] // tp
    dtype, device = experts.w1.dtype, experts.w1.device
    experts.w1 = nn.Parameter(torch.empty(e_local, experts.w1.shape[1], h_local, dtype=dtype, device=device))
    experts.w2 = nn.Parameter(torch.empty(e_local, h_local, experts.w2.shape[2], dtype=dtype, device=device))


def expert_grad_groups(ctx) -> list[dist.ProcessGroup]:
    """The groups an expert's gradient is summed over: the ranks holding the same experts (edp)."""
    return [ctx.group("edp")] if ctx.size("edp") > 1 else []


def expert_grad_scale(ctx) -> float:
    """What an expert's summed gradient is multiplied by: 1, the loss being each rank's summand.  (A plan whose loss
    is each rank's mean divides every gradient by dp; dividing the experts' by their edp group's size alone leaves
    them ep times too large: Megatron-LM PR #5956.)"""
    return 1.0


def sum_grads(model: nn.Module, ctx, expert_groups: list[dist.ProcessGroup], expert_scale: float) -> None:
    """Dense gradients summed over dp, the experts' over `expert_groups` (times `expert_scale`), as each is
    accumulated."""

    def hook(groups: list, scale: float):
        def reduce(p: torch.Tensor) -> None:
            grad = _local(p.grad)
            for group in groups:
                dist.all_reduce(grad, group=group)
            if scale != 1.0:
                grad.mul_(scale)

        return reduce

    for name, p in model.named_parameters():
        if ".experts." in name:
            p.register_post_accumulate_grad_hook(hook(expert_groups, expert_scale))
        elif ctx.size("dp") > 1:
            p.register_post_accumulate_grad_hook(hook([ctx.group("dp")], 1.0))


def parallelize(model: nn.Module, ctx) -> nn.Module:
    """The MoE decoder's plan on this rank (in place, parameter names kept): experts over ep and tp, the rest
    replicated, gradients summed."""
    block = model.layer
    shard_experts(block.moe.experts, ctx)
    block.moe = ExpertParallelMoE(block.moe, ctx)
    sum_grads(model, ctx, expert_grad_groups(ctx), expert_grad_scale(ctx))
    return model


def next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of every next token of this rank's rows (log-softmax in float32 at least)."""
    logprobs = torch.log_softmax(logits[:, :-1].to(math_dtype(logits.dtype)), dim=-1)
    return -logprobs.gather(-1, tokens[:, 1:, None]).mean().to(logits.dtype)


def loss(outputs: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor, ctx, aux_coef: float) -> torch.Tensor:
    """The whole batch's loss on every rank (value), this rank's summand of it (gradient): its rows' mean next-token
    NLL over dp (the ranks' rows are equal in number) plus aux_coef times its aux summand."""
    logits, aux = outputs
    nll = next_token_nll(logits, tokens) / ctx.size("dp")
    summand = nll + aux_coef * aux.to(nll.dtype)
    total = summand.detach().to(torch.float64, copy=True)
    if ctx.size("dp") > 1:
        dist.all_reduce(total, group=ctx.group("dp"))
    return summand + (total.to(summand.dtype) - summand).detach()
