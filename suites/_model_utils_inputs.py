"""model_utils suites: how inputs are drawn and laid out (shared by model_utils, model_utils_cp and their benchmarks).

Layouts: logits [B, S, V] are sharded on the batch over DP and on the vocab over TP (contiguous, torch.chunk
sizes, so V not divisible by TP gives uneven shards); targets are sharded over DP and replicated over TP.
Sequence-parallel hidden states [S, B, H] are sharded on S over TP and on B over DP; the output weight [V, H] on
V over TP, replicated over DP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.distributed.tensor import DTensor

from shardcheck import HeadTail, Layout, PackedHeadTail, Permuted, Shard
from shardcheck.reference import model_utils as ref

LOGITS = Layout(dp=Shard(0), tp=Shard(-1))  # [B, S, V]: batch over DP, vocab over TP
BATCH = Layout(dp=Shard(0))  # [B, ...]: batch over DP, replicated over TP
ROWS_VOCAB = Layout(dp=Shard(0), tp=Shard(1))  # 2-D [B*S, V] vocab-parallel
ROWS = Layout(dp=Shard(0), tp=Shard(0))  # 2-D [B*S, V] sequence-parallel
SEQ_HIDDEN = Layout(dp=Shard(1), tp=Shard(0))  # hidden states [S, B, H]: batch over DP, sequence over TP
WEIGHT = Layout(tp=Shard(0))  # output weight [V, H]: vocab over TP, replicated over DP


@dataclass(frozen=True)
class Draw:
    """How a case's logits are drawn and its targets masked.  Fields away from their defaults name the case
    (`tag`) and are recorded in its params (`extra`), in this order."""

    scale: float = 3.0  # logits ~ N(0, scale²); 300: huge logits (stability)
    ties: bool = False  # few distinct values: ties everywhere
    neg_inf: float = 0.0  # this fraction of the logits -inf
    huge_close_top: bool = False  # huge logits with ~15% of each row close to its max (entropy gradients)
    tie_choice: bool = False  # sampling: tied logits top-p keeps in part (any tied survivor is right)
    masked: float = 0.0  # this fraction of the targets -100, a quarter as many V+3 (both outside [0, V))
    top_gap: float | None = None  # sampling inputs: each row's runner-up at most this far below its max
    ids_int32: bool = False  # gather inputs: the ids int32, as an inference engine hands back top-k ids

    @property
    def extra(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @property
    def tag(self) -> str:
        return "".join(f"-{k}{'' if x is True else x}" for k, x in self.extra.items())

    def logits(self, gen: torch.Generator, shape) -> torch.Tensor:
        if self.huge_close_top:
            return huge_logits_close_top(gen, shape)
        return make_logits(gen, shape, self.scale, self.ties, self.neg_inf)


def make_logits(
    gen: torch.Generator, shape, scale: float = 3.0, ties: bool = False, neg_inf: float = 0.0
) -> torch.Tensor:
    """Seeded logits; `ties` rounds them to few distinct values, `neg_inf` masks that fraction to -inf."""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if ties:
        logits = torch.round(logits / scale * 2)
    if neg_inf:
        mask = torch.rand(shape, generator=gen, dtype=torch.float64) < neg_inf
        mask[..., 0] = False  # keep every row finite somewhere
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def make_targets(
    gen: torch.Generator, shape, vocab: int, masked: float = 0.0, avoid: torch.Tensor | None = None
) -> torch.Tensor:
    """Token ids in [0, V); `masked` of them -100 and a few out of range (logprob 0, no gradient).
    `avoid` (logits) keeps targets off -inf logits (index 0 is always finite)."""
    target = torch.randint(0, vocab, shape, generator=gen)
    if avoid is not None:
        target = torch.where(torch.isinf(avoid.gather(-1, target.unsqueeze(-1)).squeeze(-1)), 0, target)
    if masked:
        r = torch.rand(shape, generator=gen)
        target = torch.where(r < masked, -100, target)
        target = torch.where((r >= masked) & (r < masked * 1.25), vocab + 3, target)
    return target


def logits_and_target(gen, b: int, s: int, v: int, draw: Draw = Draw(), shift: bool = False) -> dict[str, torch.Tensor]:
    """Logits [B, S, V] and targets [B, S]; `shift`: the op scores target[t+1] with logits[t]."""
    logits = make_logits(gen, (b, s, v), draw.scale, draw.ties, draw.neg_inf)
    avoid = torch.cat([logits[:, 1:], logits[:, :1]], dim=1) if shift else logits  # shifted ops read target[t+1]
    return {"logits": logits, "target": make_targets(gen, (b, s), v, draw.masked, avoid=avoid)}


# ---- sampling (top-k / top-p) ---------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0

    @property
    def filtering(self) -> bool:
        return (self.top_k is not None and self.top_k > 0) or self.top_p < 1.0

    def tag(self) -> str:
        parts = [] if self.top_k is None else [f"k{self.top_k}"]
        parts += [f"p{self.top_p:g}"] if self.top_p < 1.0 else []
        parts += [f"T{self.temperature:g}"] if self.temperature != 1.0 else []
        return "-".join(parts) or "nofilter"

    def params(self) -> dict:
        return {"top_k": self.top_k, "top_p": self.top_p, "temperature": self.temperature}


NO_SAMPLING = Sampling()


@dataclass(frozen=True)
class TrainingSamplingParams:
    """Stand-in of nemo_rl.algorithms.logits_sampling_utils.TrainingSamplingParams, the type the seed gives
    `sampling_params` (a module the seed's model_utils imports, not one of its names): what the ops read of it."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def sampling_params(s: Sampling) -> TrainingSamplingParams | None:
    """What a case hands the op as `sampling_params`: None without sampling."""
    if s == NO_SAMPLING:
        return None
    return TrainingSamplingParams(top_k=s.top_k, top_p=s.top_p, temperature=s.temperature)


TOP_P_MARGIN = 1e-3  # cumulative probabilities stay this far from 1 - top_p: float32 vs float64 cannot flip a decision


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """Values every dtype under test holds exactly, so rounding the inputs cannot make or break a tie."""
    return x.to(torch.bfloat16).to(torch.float64)


def top_p_margin(x: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Per row: distance of the (top-k renormalised, ascending) cumulative probabilities to 1 - top_p."""
    probs = torch.softmax(ref.filter_logits(x, top_k, 1.0), dim=-1)
    cum = torch.sort(probs, dim=-1, stable=True).values.cumsum(-1)[..., :-1]  # the largest is always kept
    return (cum - (1.0 - top_p)).abs().amin(-1)


def tie_straddles(x: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Per id: whether it is in a group of equal logits that top-p keeps in part
    (docs/ops/model_utils.md#top-k--top-p-filtering lets any of the tied ids survive, so which ones do is the
    implementation's choice)."""
    top_k_kept = torch.isfinite(ref.filter_logits(x, top_k, 1.0))
    kept = torch.isfinite(ref.filter_logits(x, top_k, top_p))
    same = x[..., :, None] == x[..., None, :]
    some_kept = (same & kept[..., None, :]).any(-1)
    some_dropped = (same & (top_k_kept & ~kept)[..., None, :]).any(-1)
    return top_k_kept & some_kept & some_dropped


def cap_top_gap(x: torch.Tensor, gap: float) -> torch.Tensor:
    """Rows whose runner-up is more than `gap` below the max get it (every id at that value) moved up to the
    bf16-exact value nearest max − gap.  A softmax more one-hot than e^−gap has a log-prob gradient at its argmax,
    1 − p_max, below float64's own rounding of p_max: no golden can referee it to 1e-10 of its size."""
    if x.shape[-1] < 2:
        return x
    top2 = x.topk(2, dim=-1).values
    far = (top2[..., :1] - top2[..., 1:]) > gap
    return torch.where(far & (x == top2[..., 1:]), bf16_exact(top2[..., :1] - gap), x)


def _sampling_rows(gen, shape, draw: Draw) -> torch.Tensor:
    logits = bf16_exact(make_logits(gen, shape, draw.scale, draw.ties))
    return logits if draw.top_gap is None else cap_top_gap(logits, draw.top_gap)


def sampling_logits(gen, shape, sampling: Sampling, draw: Draw = Draw()) -> torch.Tensor:
    """bf16-exact logits whose top-p decisions are not on a knife edge (rows too close are redrawn), and,
    unless `draw.tie_choice`, whose tied logits top-p keeps all or none of (so every valid implementation
    gives the same values and gradients).  `draw.top_gap`: see cap_top_gap."""
    logits = _sampling_rows(gen, shape, draw)
    if sampling.top_p >= 1.0:
        return logits
    for _ in range(200):
        scaled = logits / sampling.temperature
        bad = top_p_margin(scaled, sampling.top_k, sampling.top_p) < TOP_P_MARGIN
        if not draw.tie_choice:
            bad |= tie_straddles(scaled, sampling.top_k, sampling.top_p).any(-1)
        if not bad.any():
            return logits
        logits[bad] = _sampling_rows(gen, (int(bad.sum()), shape[-1]), draw)
    raise RuntimeError(f"could not draw logits {shape} away from the top_p={sampling.top_p} edges")


def mask_ids(gen, ids: torch.Tensor, vocab: int, masked: float) -> torch.Tensor:
    """`masked` of the ids -100 and a quarter as many V+3: both outside [0, V) (0, no gradient)."""
    if not masked:
        return ids
    r = torch.rand(ids.shape, generator=gen)
    ids = torch.where(r < masked, -100, ids)
    return torch.where((r >= masked) & (r < masked * 1.25), vocab + 3, ids)


def sampling_inputs(
    gen, b: int, s: int, v: int, sampling: Sampling, draw: Draw = Draw(), shift: bool = False
) -> dict[str, torch.Tensor]:
    """Logits and targets: a third of the targets on their row's argmax (the last of tied maxima), a
    third among the row's 3 largest logits, a third uniform (often filtered out: logprob -inf)."""
    logits = sampling_logits(gen, (b, s, v), sampling, draw)
    target = torch.randint(0, v, (b, s), generator=gen)
    top3 = logits.topk(3, dim=-1).indices.gather(-1, torch.randint(0, 3, (b, s, 1), generator=gen)).squeeze(-1)
    last_argmax = v - 1 - logits.flip(-1).argmax(-1)
    r = torch.rand((b, s), generator=gen)
    target = torch.where(r < 1 / 3, last_argmax, torch.where(r < 2 / 3, top3, target))
    target = mask_ids(gen, target, v, draw.masked)
    if shift:  # next-token ops score target[t+1] with logits[t]
        target = target.roll(1, dims=1)
    return {"logits": logits, "target": target}


# ---- ids, teacher top-k, hidden states ------------------------------------------------------


def make_indices(gen, b: int, s: int, k: int, v: int, dup: bool = True, masked: float = 0.0) -> torch.Tensor:
    """[B,S,K] global ids; `dup`: the last id repeats the first (and a third of positions repeat one id K times)."""
    idx = torch.randint(0, v, (b, s, k), generator=gen)
    if dup:
        idx[..., -1] = idx[..., 0]
        same = torch.rand((b, s), generator=gen) < 1 / 3
        idx = torch.where(same[..., None], idx[..., :1].expand(b, s, k), idx)
    return mask_ids(gen, idx, v, masked)


def gather_inputs(gen, b: int, s: int, v: int, k: int, draw: Draw = Draw()) -> dict[str, torch.Tensor]:
    """Logits [B, S, V] and K ids per position (duplicates included, `draw.masked` of them outside [0, V))."""
    logits = make_logits(gen, (b, s, v), draw.scale, draw.ties, draw.neg_inf)
    ids = make_indices(gen, b, s, k, v, dup=True, masked=draw.masked)
    return {"logits": logits, "indices": ids.int() if draw.ids_int32 else ids}


def distill_inputs(gen, b: int, s: int, v: int, k: int, draw: Draw = Draw()) -> dict[str, torch.Tensor]:
    """Student logits [B, S, V], a teacher's top-K logits (descending) and its K distinct ids."""
    teacher = make_logits(gen, (b, s, k)).sort(dim=-1, descending=True).values  # a teacher's top-k logits
    ids = torch.rand((b, s, v), generator=gen).argsort(dim=-1)[..., :k]  # distinct ids, as top-k gives
    return {
        "student_logits": make_logits(gen, (b, s, v), draw.scale, draw.ties, draw.neg_inf),
        "teacher_topk_logits": teacher,
        "teacher_topk_indices": ids,
    }


def huge_logits_close_top(gen, shape, scale: float = 300.0) -> torch.Tensor:
    """Huge logits (x100) with ~15% of each row's ids moved to within 6 of the row's max: the max
    subtraction is stressed, yet the softmax is not one-hot everywhere.  (When every row is one-hot
    the entropy gradient is ~1e-17 and the float64 golden, differentiated by autograd through
    p log p, is off by ~eps * p in absolute terms.)"""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    close = torch.rand(shape, generator=gen) < 0.15
    runner_up = logits.amax(-1, keepdim=True) - 6 * torch.rand(shape, generator=gen, dtype=torch.float64)
    return torch.where(close, runner_up, logits)


def hidden_inputs(
    gen, s: int, b: int, h: int, v: int, scale: float = 1.0, masked: float = 0.0
) -> dict[str, torch.Tensor]:
    """hidden [S,B,H], weight [V,H] (logits ~ N(0, H) * scale^2) and target ids [B,S]."""
    return {
        "hidden": torch.randn((s, b, h), generator=gen, dtype=torch.float64) * scale,
        "weight": torch.randn((v, h), generator=gen, dtype=torch.float64) * scale,
        "target": make_targets(gen, (b, s), v, masked),
    }


def hidden_logits(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference's LM-head projection: [S,B,H] x [V,H] -> [B,S,V] in the input dtype."""
    return torch.matmul(x["hidden"].transpose(0, 1), x["weight"].t())


# ---- what the op is handed ------------------------------------------------------------------


def dtensor(ctx, local: torch.Tensor, name: str, layout: Layout, dims: tuple[str, ...] = ("cp", "tp")) -> DTensor:
    """The DTensor whose local piece on this rank is `local` (uneven shards included), on the sub-mesh `dims` as
    upstream's callers build it: logits on the (cp, tp) mesh, input ids on the cp mesh, never on DP (each DP rank's
    DTensor is its own batch piece, so `full_tensor()` is that piece, not the global batch).  A dim laid out by a
    CP index rule is a Shard of the (permuted) sequence, as upstream builds it."""
    full = torch.Size(ctx.full_shapes[name])
    placements = dict(zip(("dp", "cp", "tp"), layout.placements))
    shape = list(full)
    if isinstance(placements["dp"], Shard):  # the DP piece is this DTensor's whole tensor
        d = placements["dp"].dim % len(full)
        pieces = torch.arange(full[d]).chunk(ctx.size("dp"))  # torch.chunk sizes, as the layout cuts it
        shape[d] = len(pieces[ctx.rank("dp")]) if ctx.rank("dp") < len(pieces) else 0
    shape = torch.Size(shape)
    on_mesh = [
        Shard(p.dim % len(shape)) if isinstance(p, (Shard, HeadTail, PackedHeadTail, Permuted)) else p
        for p in (placements[d] for d in dims)
    ]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ctx.mesh[dims], on_mesh, run_check=False, shape=shape, stride=stride)


def vocab_range(ctx, name: str = "logits") -> tuple[int, int]:
    """[vocab_start_index, vocab_end_index) of this rank's vocab shard of input `name`."""
    return ctx.local_range(name, -1)


def batch_divides(b: int):
    """supports: B splits over DP."""
    return lambda topo: b % topo.dp == 0


def all_to_all_fits(b: int, s: int, v: int):
    """supports of the sampling layout: B divides over DP, the local B*S rows over TP, and the vocab evenly."""
    return lambda t: b % t.dp == 0 and (b // t.dp * s) % t.tp == 0 and v % t.tp == 0


def even_vocab(b: int, v: int):
    """supports: B splits over DP and V evenly over TP (ops that take a vocab_parallel_rank)."""
    return lambda t: b % t.dp == 0 and v % t.tp == 0
