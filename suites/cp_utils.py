"""Suite for nemo_automodel.components.distributed.cp_utils: a context-parallel training step on CPU.

Every case shards inside the op (full inputs in), so every case sets `context_parallel=True` and
runs at cp 1, 2 and 4 (tp 1 only: nothing here is tensor-parallel).

- End-to-end step (`make_cp_batch_and_ctx`, `create_context_parallel_ctx` + `get_train_context`):
  reference.attention_block_loss (embedding, q/k/v, causal SDPA, output projection, token
  cross-entropy) run on the CP batch inside the CP context.  Batch rows are split over DP and
  replicated over CP; each rank's loss (its valid tokens' sum / the global count) is a summand,
  so the loss is `Partial` over dp and cp.  Parameters are replicated: `GradSum` (a DDP stand-in)
  sums their gradients over cp and dp, so every rank's gradient is the single-device one; a
  trainable `inputs_embeds` gets its gradient summed over cp.  Checked: loss and every gradient on
  every rank, float64 to 1e-10, plus the exact collectives (`step_comm`).
- Layouts (properties): what each rank holds inside the context is the head-tail piece of the
  (padded) buffer; restored buffers equal their originals after exit, no-restore ones stay sharded.
- THD (properties): every key of make_cp_batch_for_te / _shard_thd_chunk_for_te against the
  single-device conversion (reference.thd_batch) cut by the harness's own head-tail rule, and the
  rank pieces all-gathered and reassembled into the unsharded batch.
- Bad input: every ValueError / KeyError of docs/ops/cp_utils.md, one case each (`property:bad_input`): the op must
  raise, or, for a sequence 2·CP does not divide, pad it and get the real tokens' loss and gradients right.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardcheck import BadInput, Case, FuzzSpace, GradSum, HeadTail, Layout, Partial, Property, Shard, cite, ours, seed
from shardcheck.reference import cp_utils as ref
from shardcheck.suites._fuzz_draws import DTYPES
from shardcheck.suites._fuzz_draws import topology as fuzz_topology

FAMILY = "cp_utils"
OP = FAMILY + "."


def head_tail(length: int, cp: int, r: int) -> torch.Tensor:
    """Positions CP rank r holds of `length` in the load-balanced layout: the harness's own rule (HeadTail)."""
    return HeadTail(dim=0).positions(length, cp, r, {})


N_HEADS = 2
SENTINEL = -1000
ROWS = Layout(dp=Shard(0))  # [B, ...]: rows over DP, replicated over CP (the op shards over CP)
MROPE_ROWS = Layout(dp=Shard(1))  # [3, B, S]
LOSS = Layout(dp=Partial(), cp=Partial())  # each DP/CP rank's loss is a summand of the global loss
PARAMS = ref.PARAM_NAMES


def _cp_or_single(topo) -> bool:
    """CP > 1 (with or without DP), or one rank: DP alone exercises nothing of cp_utils (a no-op at cp 1)."""
    return topo.tp == 1 and (topo.cp > 1 or topo.size == 1)


def _single_dp(topo) -> bool:
    return topo.tp == 1 and topo.dp == 1


def _cp_only(topo) -> bool:
    return topo.tp == 1 and topo.dp == 1 and topo.cp > 1


# ---- the end-to-end step -------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    via: str  # "batch": make_cp_batch_and_ctx; "ctx": create_context_parallel_ctx + get_train_context
    b: int = 2
    s: int = 10
    hidden: int = 8
    vocab: int = 11
    rotate: str = "allgather"
    embeds: bool = False  # inputs_embeds (requires grad) instead of input_ids
    positions: str = "none"  # "none" (built by the op), "given" [B, S], "mrope" [3, B, S]
    loss_mask: bool = True  # a loss_mask with holes (else labels with -100 holes only)
    attention_mask: bool = False  # an all-ones attention_mask the op must drop
    tag: str = ""

    @property
    def case_id(self) -> str:
        parts = [
            self.via,
            self.rotate,
            f"b{self.b}s{self.s}h{self.hidden}v{self.vocab}",
            "embeds" if self.embeds else "ids",
            f"pos-{self.positions}",
        ]
        parts += ["lossmask"] if self.loss_mask else []
        parts += ["attnmask"] if self.attention_mask else []
        return "-".join(parts + ([self.tag] if self.tag else []))

    @property
    def params(self) -> dict:
        return {
            "via": self.via,
            "B": self.b,
            "S": self.s,
            "hidden": self.hidden,
            "V": self.vocab,
            "heads": N_HEADS,
            "rotate": self.rotate,
            "inputs_embeds": self.embeds,
            "positions": self.positions,
            "loss_mask": self.loss_mask,
            "attention_mask": self.attention_mask,
        }


def _param_names(spec: StepSpec) -> tuple[str, ...]:
    return tuple(p for p in PARAMS if not (spec.embeds and p == "embed"))


def _step_inputs(spec: StepSpec):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        b, s, h, v = spec.b, spec.s, spec.hidden, spec.vocab
        x = {
            "pos_embed": torch.randn((s, h), generator=gen, dtype=torch.float64) * 0.5,
            "wqkv": torch.randn((3 * h, h), generator=gen, dtype=torch.float64) * h**-0.5,
            "wo": torch.randn((h, h), generator=gen, dtype=torch.float64) * h**-0.5,
            "lm_head": torch.randn((v, h), generator=gen, dtype=torch.float64) * h**-0.5,
        }
        if spec.embeds:  # no embedding table then
            x["inputs_embeds"] = torch.randn((b, s, h), generator=gen, dtype=torch.float64)
        else:
            x["embed"] = torch.randn((v, h), generator=gen, dtype=torch.float64)
            x["input_ids"] = torch.randint(0, v, (b, s), generator=gen)
        labels = torch.randint(0, v, (b, s), generator=gen)
        labels[torch.rand((b, s), generator=gen) < 0.2] = -100  # ignored tokens
        labels[:, 0] = 0  # every row keeps a valid first token
        x["labels"] = labels
        loss_mask = None
        if spec.loss_mask:
            loss_mask = (torch.rand((b, s), generator=gen) > 0.25).long()  # holes
            loss_mask[:, 0] = 1
            x["loss_mask"] = loss_mask
        if spec.positions == "given":
            x["position_ids"] = torch.randint(0, s, (b, s), generator=gen)
        elif spec.positions == "mrope":
            x["position_ids"] = torch.randint(0, s, (3, b, s), generator=gen)
        if spec.attention_mask:
            x["attention_mask"] = torch.ones((b, s), dtype=torch.long)
        x["num_valid"] = ref.count_valid(labels, loss_mask)  # global: every rank divides by it
        return x

    return make


def _reference_batch(x: dict, s: int) -> dict:
    batch = {
        k: x[k]
        for k in ("input_ids", "inputs_embeds", "labels", "loss_mask", "attention_mask", "position_ids")
        if k in x
    }
    batch.setdefault("position_ids", torch.arange(s).unsqueeze(0))
    return batch


def _step_reference(spec: StepSpec):
    def reference(x):
        params = {n: x[n] for n in PARAMS if n in x}
        return ref.attention_block_loss(params, _reference_batch(x, spec.s), x["num_valid"], N_HEADS)

    return reference


def _step_run(spec: StepSpec):
    def run(impl, ctx, x):
        cp_group, dp_group = ctx.group("cp"), ctx.group("dp")
        params = {n: GradSum.apply(x[n], (cp_group, dp_group)) for n in PARAMS if n in x}
        batch = {"labels": x["labels"].clone()}
        if spec.embeds:
            batch["inputs_embeds"] = GradSum.apply(x["inputs_embeds"], (cp_group,))
        else:
            batch["input_ids"] = x["input_ids"].clone()
        if "position_ids" in x:
            batch["position_ids"] = x["position_ids"].clone()
        if "attention_mask" in x:
            batch["attention_mask"] = x["attention_mask"].clone()
        loss_mask = x["loss_mask"].clone() if "loss_mask" in x else None
        if spec.via == "batch":
            train_ctx, batch = impl.make_cp_batch_and_ctx(ctx.mesh, batch, loss_mask=loss_mask)
            if loss_mask is not None and "loss_mask" not in batch:  # CP off: the batch comes back as it was
                batch["loss_mask"] = loss_mask
        else:  # the caller's own buffers, unpadded
            b_local = batch["labels"].shape[0]
            batch["position_ids"] = torch.arange(spec.s, device=ctx.device).expand(b_local, spec.s).contiguous()
            names = ["input_ids", "labels", "position_ids"]
            if loss_mask is not None:
                batch["loss_mask"] = loss_mask
                names.append("loss_mask")
            buffers = [batch[n] for n in names]
            no_restore = {batch["labels"]} | ({loss_mask} if loss_mask is not None else set())
            cp_ctx = impl.create_context_parallel_ctx(
                ctx.mesh["cp"], buffers, [1] * len(buffers), no_restore, cp_rotate_method=spec.rotate
            )
            train_ctx = impl.get_train_context(False, False, cp_ctx)
        # As in a training loop, the step's backward runs inside the train context: an implementation that
        # delegates to torch's context_parallel has its attention backward only while the context is open.
        ctx.keep_open(train_ctx())
        return ref.attention_block_loss(params, batch, x["num_valid"], N_HEADS)

    return run


def _padded_len(s: int, cp: int) -> int:
    return -(-s // (2 * cp)) * 2 * cp


def step_comm(spec: StepSpec):
    """Collectives of one CP step on one rank, exactly.

    kv = the stacked local K and V of the one attention layer, 2·B_local·(S_pad/CP)·hidden elements
    (hidden = heads·head_dim), e_in bytes (the model dtype), e_c the compute dtype's (float32 or better).
    - allgather: forward one all_gather@cp of kv (lower bound for exact attention with all-gather
      rotation: every rank needs every K/V once); backward the same all-gather again (only the local
      K/V is kept: activations shrink 1/CP) and the partial K/V gradients back to their owners,
      CP·kv·e_c bytes: one reduce_scatter@cp of [CP, kv], or (torch's own CP, whatever the rotate
      method) a ring of CP all_to_all@cp of kv each.
    - alltoall (ring): forward CP−1 all_to_all@cp of kv (each rank meets every other block once);
      backward the K/V block again CP−1 times, its gradient accumulator CP−1 times with it and once
      more to its owner: 2·CP−1 calls, (CP−1)·kv·e_in + CP·kv·e_c bytes.
    - CP = 1 through create_context_parallel_ctx: nothing, or (torch's own CP) one all_to_all@cp of the
      K/V gradient (kv·e_c) on the 1-rank group.
    - the DDP stand-in: one all_reduce@cp (and @dp) per parameter gradient, e_c, plus the
      inputs_embeds gradient over cp ([B_local, S, hidden], e_c).
    Batch sharding and the loss add nothing (the loss is a Partial summand)."""

    def comm(ctx) -> dict:
        cp, dp = ctx.size("cp"), ctx.size("dp")
        e_in, e_c = ctx.dtype.itemsize, torch.promote_types(ctx.dtype, torch.float32).itemsize
        b_local = spec.b // dp
        s_pad = _padded_len(spec.s, cp) if spec.via == "batch" else spec.s
        kv = 2 * b_local * (s_pad // cp) * spec.hidden
        h, v = spec.hidden, spec.vocab
        param_numel = spec.s * h + 3 * h * h + h * h + v * h + (0 if spec.embeds else v * h)
        n_params = len(_param_names(spec))
        fwd, bwd = {}, {}
        if cp > 1:
            if spec.via == "batch" or spec.rotate == "allgather":
                fwd["all_gather@cp"] = (1, kv * e_in)
                bwd["all_gather@cp"] = (1, kv * e_in)
                bwd["reduce_scatter@cp"] = (1, cp * kv * e_c)
                bwd["all_to_all@cp"] = (cp, cp * kv * e_c)
            else:
                fwd["all_to_all@cp"] = (cp - 1, (cp - 1) * kv * e_in)
                bwd["all_to_all@cp"] = (2 * cp - 1, (cp - 1) * kv * e_in + cp * kv * e_c)
            calls, nbytes = n_params, param_numel * e_c
            if spec.embeds:
                calls, nbytes = calls + 1, nbytes + b_local * spec.s * h * e_c
            bwd["all_reduce@cp"] = (calls, nbytes)
        elif spec.via == "ctx":  # torch's own CP runs its ring on a 1-rank mesh too: the K/V gradient to itself
            bwd["all_to_all@cp"] = (1, kv * e_c)
        if dp > 1:
            bwd["all_reduce@dp"] = (n_params, param_numel * e_c)
        return {"forward": fwd, "backward": bwd}

    return comm


def step_case(spec: StepSpec, dtypes=("float64", "float32", "bfloat16")) -> Case:
    layouts = {
        "input_ids": ROWS,
        "inputs_embeds": ROWS,
        "labels": ROWS,
        "loss_mask": ROWS,
        "attention_mask": ROWS,
        "position_ids": MROPE_ROWS if spec.positions == "mrope" else ROWS,
    }
    op = "make_cp_batch_and_ctx" if spec.via == "batch" else "create_context_parallel_ctx"
    return Case(
        op=OP + op,
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=_step_inputs(spec),
        reference=_step_reference(spec),
        run=_step_run(spec),
        input_layouts=layouts,
        output_layouts=(LOSS,),
        output_names=("loss",),
        grad_inputs=_param_names(spec) + (("inputs_embeds",) if spec.embeds else ()),
        comm=step_comm(spec),
        dtypes=dtypes,
        context_parallel=True,
        cp_lengths=(spec.s,) if spec.via == "ctx" else (),  # (make_cp_batch_and_ctx pads the batch itself)
        supports=lambda t, b=spec.b: _cp_or_single(t) and b % t.dp == 0,
    )


STEP_SPECS = (
    # make_cp_batch_and_ctx (all-gather rotation): S = 10 is padded at cp 2 (to 12) and cp 4 (to 16)
    StepSpec("batch", attention_mask=True),
    StepSpec("batch", positions="given", loss_mask=False),  # padded labels must be -100: no loss_mask hides them
    StepSpec("batch", embeds=True),
    StepSpec("batch", b=4, s=16, positions="mrope"),
    # create_context_parallel_ctx directly, both rotations
    StepSpec("ctx", s=16, rotate="allgather"),
    StepSpec("ctx", s=16, rotate="alltoall"),
    StepSpec("ctx", b=4, s=8, rotate="alltoall", loss_mask=False),
)
QUICK_STEP_SPECS = (STEP_SPECS[0], STEP_SPECS[2], STEP_SPECS[5])


# ---- layouts inside and after the context ----------------------------------------------------


def _equal(name: str, got, expected: torch.Tensor, where: str = "") -> Property:
    """Exact equality (sharding copies values), with the first differing position."""
    if not isinstance(got, torch.Tensor):
        return Property(name, False, None, f"got {type(got).__name__}, expected a tensor {tuple(expected.shape)}")
    got = got.detach().cpu()
    if tuple(got.shape) != tuple(expected.shape):
        return Property(name, False, None, f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}{where}")
    if got.dtype != expected.dtype:
        return Property(name, False, None, f"dtype {got.dtype}, expected {expected.dtype}")
    diff = got != expected
    if diff.any():
        idx = tuple(int(i) for i in diff.nonzero()[0])
        return Property(
            name,
            False,
            float(diff.sum()),
            f"{int(diff.sum())} element(s) differ; first at local index "
            f"{idx}: expected {expected[idx].item()}, got {got[idx].item()}{where}",
        )
    return Property(name, True, 0.0, "")


def _layout_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    b, s = 2, 10
    labels = torch.randint(0, 7, (b, s), generator=gen)
    labels[0, 3] = -100
    return {
        "input_ids": torch.randint(1, 7, (b, s), generator=gen),
        "labels": labels,
        "loss_mask": (torch.rand((b, s), generator=gen) > 0.3).long(),
        "padding_mask": torch.rand((b, s), generator=gen) > 0.8,
        "attention_mask": torch.ones((b, s), dtype=torch.long),
    }


def _batch_layout_run(impl, ctx, x):
    batch = {k: x[k].clone() for k in ("input_ids", "labels", "padding_mask", "attention_mask")}
    train_ctx, out_batch = impl.make_cp_batch_and_ctx(ctx.mesh, batch, loss_mask=x["loss_mask"].clone())
    with train_ctx():
        inside = {k: v.clone() for k, v in out_batch.items() if isinstance(v, torch.Tensor)}
    after = {k: v.clone() for k, v in out_batch.items() if isinstance(v, torch.Tensor)}
    return {"factory": train_ctx, "same_dict": out_batch is batch, "inside": inside, "after": after}


def _mask_dropped(mask, local_len: int) -> Property:
    """attention_mask gone from the batch inside the context: ours (docs/ops); kept but not sharded with the rest
    (its sequence not `local_len` long), the seed's 'accordingly sharded' is broken too."""
    if mask is None:
        return Property("attention_mask_dropped", True, None, "")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[1] == local_len:
        return Property(
            "attention_mask_dropped",
            False,
            None,
            f"attention_mask is still in the batch, sharded "
            f"{tuple(mask.shape)} with the rest: dropped by our rule (CP attention is causal)",
        )
    shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    return Property(
        "attention_mask_dropped",
        False,
        None,
        f"attention_mask is still in the batch, {shape}, not sharded with the rest ({local_len} positions per rank)",
        rule=_SHARDED,
    )


def _batch_layout_properties(ctx, full, local, outs):
    res = outs[0]
    cp, r = ctx.size("cp"), ctx.rank("cp")
    if cp == 1:  # a no-op: nullcontext and the batch unchanged, attention_mask included
        props = [
            Property(
                "noop:nullcontext",
                isinstance(res["factory"](), nullcontext),
                None,
                f"factory gives {type(res['factory']()).__name__}",
            )
        ]
        for k in ("input_ids", "labels", "padding_mask", "attention_mask"):
            props.append(_equal(f"noop:{k}", res["after"].get(k), full[k]))
        return props
    padded = ref.padded_batch(
        {k: full[k] for k in ("input_ids", "labels", "loss_mask", "padding_mask", "attention_mask")}, cp
    )
    s_pad = padded["input_ids"].shape[1]
    index = head_tail(s_pad, cp, r)
    props = [_mask_dropped(res["inside"].get("attention_mask"), s_pad // cp)]
    for k in ("input_ids", "labels", "position_ids", "loss_mask", "padding_mask"):
        expected = padded[k].expand(full["input_ids"].shape[0], -1) if k == "position_ids" else padded[k]
        where = f" (head-tail positions {index.tolist()} of {s_pad})"
        inside = _equal(f"inside:{k}", res["inside"].get(k), expected.index_select(1, index), where)
        props.append(_ours_if_unpadded(inside, res["inside"].get(k), full, k, ctx))
        after = expected if k == "position_ids" else expected.index_select(1, index)  # only position_ids restored
        prop = _equal(f"after:{k}", res["after"].get(k), after, " after exit")
        got = res["after"].get(k)
        if not prop.passed and isinstance(got, torch.Tensor) and got.shape == after.shape:
            prop.rule = _SHARDED  # restored or not as ours says, wrong values: the seed's, as inside the context
        props.append(prop)
    return props


def _ours_if_unpadded(prop: Property, got, full: dict, key: str, ctx) -> Property:
    """A buffer inside the context that is not the padded head-tail piece may still be what the seed asks: torch's
    context_parallel itself, given a sequence not divisible by 2·CP, turns load balancing off and shards it in
    contiguous chunks, attention exact (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py,
    _create_default_load_balancer).  That piece, or loss_mask (an argument, not the batch) missing from the batch, is
    the padding and the batch key of our rule: ours, not the seed's "accordingly sharded" (issue 42)."""
    if prop.passed:
        return prop
    cp, r = ctx.size("cp"), ctx.rank("cp")
    if got is None and key == "loss_mask":
        prop.rule = ours(f"{DOC}#make_cp_batch_and_ctx")
        prop.message += " (the loss_mask argument not returned in the batch: our rule returns it there)"
        return prop
    whole = full[key] if key != "position_ids" else torch.arange(full["input_ids"].shape[1])[None]
    chunks = whole.chunk(cp, dim=1)
    balanced = whole.shape[1] % (2 * cp) == 0  # then torch balances (head-tail): a contiguous chunk is wrong
    if not balanced and r < len(chunks) and isinstance(got, torch.Tensor) and _equal(prop.name, got, chunks[r]).passed:
        prop.rule = ours(f"{DOC}#make_cp_batch_and_ctx")
        prop.message += " (got torch's contiguous chunk of the unpadded sequence, load balancing off: our rule pads)"
    return prop


def _ctx_layout_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    s = 16
    return {
        "tokens": torch.randint(0, 100, (2, s), generator=gen),  # seq dim 1
        "hidden": torch.randn((2, 3, s, 4), generator=gen, dtype=torch.float64),  # seq dim 2
        "seq_first": torch.randn((s, 5), generator=gen, dtype=torch.float64),  # seq dim 0
        "kept": torch.randint(0, 100, (3, s), generator=gen),
    }  # seq dim 1, no restore


LAYOUT_BUFFERS = (("tokens", 1), ("hidden", 2), ("seq_first", 0), ("kept", 1))


def _ctx_layout_run(impl, ctx, x):
    buffers = {k: x[k].clone() for k, _ in LAYOUT_BUFFERS}
    original_sdpa = F.scaled_dot_product_attention
    cp_ctx = impl.create_context_parallel_ctx(
        ctx.mesh["cp"], [buffers[k] for k, _ in LAYOUT_BUFFERS], [d for _, d in LAYOUT_BUFFERS], {buffers["kept"]}
    )
    untouched = {k: v.clone() for k, v in buffers.items()}  # creating the context shards nothing yet
    with cp_ctx:
        inside = {k: v.clone() for k, v in buffers.items()}
        patched = F.scaled_dot_product_attention is not original_sdpa
    unpatched = F.scaled_dot_product_attention is original_sdpa
    F.scaled_dot_product_attention = original_sdpa  # never leak a patch into later cases
    return {"untouched": untouched, "inside": inside, "after": buffers, "patched": patched, "unpatched": unpatched}


def _ctx_layout_properties(ctx, full, local, outs):
    res = outs[0]
    cp, r = ctx.size("cp"), ctx.rank("cp")
    props = [
        Property("sdpa_patched_inside", bool(res["patched"]) or cp == 1, None, ""),
        Property("sdpa_restored_after", bool(res["unpatched"]), None, ""),
    ]
    for k, dim in LAYOUT_BUFFERS:
        index = head_tail(full[k].shape[dim], cp, r)
        shard = full[k].index_select(dim, index)
        props.append(_equal(f"created:{k}", res["untouched"][k], full[k], " before enter"))
        props.append(
            _equal(f"inside:{k}", res["inside"][k], shard, f" (dim {dim}, head-tail positions {index.tolist()})")
        )
        props.append(
            _equal(
                f"after:{k}",
                res["after"][k],
                shard if k == "kept" else full[k],
                " after exit" + (" (no-restore: stays sharded)" if k == "kept" else " (restored)"),
            )
        )
    return props


def layout_cases() -> list[Case]:
    return [
        Case(
            op=OP + "make_cp_batch_and_ctx",
            case_id="layout-b2s10-pad-masks",
            params={"B": 2, "S": 10},
            make_inputs=_layout_inputs,
            reference=lambda x: (),
            run=_batch_layout_run,
            output_layouts=(),
            output_names=(),
            properties=_batch_layout_properties,
            dtypes=("float64",),
            context_parallel=True,
            supports=_single_dp,
            # which of the batch's buffers stay sharded after exit is this op's choice (no-restore buffers), which
            # the seed does not state; create_context_parallel_ctx's own case is the seed's ("no restore buffers")
            rules={"property:after:*": ours(f"{DOC}#make_cp_batch_and_ctx")},
        ),
        Case(
            op=OP + "create_context_parallel_ctx",
            case_id="layout-s16-dims-0-1-2-norestore",
            params={"S": 16},
            make_inputs=_ctx_layout_inputs,
            reference=lambda x: (),
            run=_ctx_layout_run,
            output_layouts=(),
            output_names=(),
            properties=_ctx_layout_properties,
            dtypes=("float64",),
            context_parallel=True,
            cp_lengths=(16,),
            supports=_single_dp,
        ),
        Case(
            op=OP + "_build_position_ids",
            case_id="missing-and-present",
            params={"S": 6},
            make_inputs=lambda gen: {
                "input_ids": torch.randint(0, 9, (2, 6), generator=gen),
                "position_ids": torch.randint(0, 6, (2, 6), generator=gen),
            },
            reference=lambda x: (),
            run=_position_ids_run,
            output_layouts=(),
            output_names=(),
            properties=_position_ids_properties,
            dtypes=("float64",),
            supports=_single_dp,
        ),
    ]


def _position_ids_run(impl, ctx, x):
    without = {"input_ids": x["input_ids"].clone()}
    with_given = {"input_ids": x["input_ids"].clone(), "position_ids": x["position_ids"].clone()}
    return {
        "built": impl._build_position_ids(without, ctx.device),
        "kept": impl._build_position_ids(with_given, ctx.device),
    }


def _position_ids_properties(ctx, full, local, outs):
    res = outs[0]
    return [
        _equal("built", res["built"].get("position_ids"), torch.arange(6).unsqueeze(0)),
        _equal("kept", res["kept"].get("position_ids"), full["position_ids"]),
    ]


# ---- THD packed batches ----------------------------------------------------------------------


@dataclass(frozen=True)
class ThdSpec:
    name: str
    lens: tuple  # per row: ((real, padded), ...); SENTINEL entries are absent packs
    s: int
    vocab: int = 4  # small: many real tokens equal the padding id
    padding_token_id: int = 0
    num_chunks: int = 1
    positions: bool = False  # position_ids given in the batch
    embeds: int = 0  # input_ids as [B, S, embeds] floats
    direct: bool = False  # _shard_thd_chunk_for_te on the batch converted to THD, instead of make_cp_batch_for_te
    use_te: bool = False  # through make_cp_batch_and_ctx(use_te=True) (at cp > 1: at cp 1 it is a no-op)

    @property
    def params(self) -> dict:
        return {
            "seq_lens": [[r for r, _ in row] for row in self.lens],
            "seq_lens_padded": [[p for _, p in row] for row in self.lens],
            "S": self.s,
            "padding_token_id": self.padding_token_id,
            "num_chunks": self.num_chunks,
            "position_ids": self.positions,
            "embeds": self.embeds,
            "direct": self.direct,
            "use_te": self.use_te,
        }


def _thd_inputs(spec: ThdSpec):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        b = len(spec.lens)
        packs = max(len(row) for row in spec.lens)
        seq_lens = torch.full((b, packs), SENTINEL)
        seq_lens_padded = torch.full((b, packs), SENTINEL)
        if spec.embeds:
            input_ids = torch.randn((b, spec.s, spec.embeds), generator=gen, dtype=torch.float64)
        else:
            input_ids = torch.randint(0, spec.vocab, (b, spec.s), generator=gen)
        labels = torch.randint(0, spec.vocab, (b, spec.s), generator=gen)
        for row, row_lens in enumerate(spec.lens):
            offset = 0
            for i, (real, padded) in enumerate(row_lens):
                seq_lens[row, i], seq_lens_padded[row, i] = real, padded
                if padded == SENTINEL:
                    continue
                if not spec.embeds:  # padding positions hold the padding id, as real data would
                    input_ids[row, offset + real : offset + padded] = spec.padding_token_id
                labels[row, offset + real : offset + padded] = -100
                offset += padded
        x = {"input_ids": input_ids, "labels": labels, "seq_lens": seq_lens, "seq_lens_padded": seq_lens_padded}
        if spec.positions:
            x["position_ids"] = torch.randint(0, spec.s, (b, spec.s), generator=gen)
        return x

    return make


def _thd_batch(x: dict) -> dict:
    return {k: x[k].clone() for k in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded") if k in x}


def _thd_run(spec: ThdSpec):
    def run(impl, ctx, x):
        cp_mesh = ctx.mesh["cp"]
        if spec.use_te:
            _, out = impl.make_cp_batch_and_ctx(
                ctx.mesh,
                _thd_batch(x),
                use_te=True,
                padding_token_id=spec.padding_token_id,
                seq_lens_padding_value=SENTINEL,
            )
            return out
        if spec.direct:  # handed a THD batch, as make_cp_batch_for_te hands it one (the conversion's output)
            thd = ref.thd_batch(_thd_batch(x), spec.padding_token_id, 1, SENTINEL)
            return impl._shard_thd_chunk_for_te(thd, cp_mesh, "thd", SENTINEL, spec.padding_token_id)
        return impl.make_cp_batch_for_te(
            cp_mesh,
            _thd_batch(x),
            padding_token_id=spec.padding_token_id,
            num_chunks=spec.num_chunks,
            seq_lens_padding_value=SENTINEL,
        )

    return run


THD_TOKEN_KEYS = {"input_ids": None, "labels": -100, "position_ids": 0, "padding_mask": True}  # fill of stacked chunks


def _thd_local(full_row: torch.Tensor, bounds: list[int], cp: int, r: int) -> torch.Tensor:
    """This rank's tokens of one THD chunk: the harness's head-tail rule applied per sequence."""
    index = torch.cat([a + head_tail(b - a, cp, r) for a, b in zip(bounds[:-1], bounds[1:])])
    return full_row.index_select(0, index)


def _thd_expected(spec: ThdSpec, full: dict, cp: int, r: int) -> tuple[dict, dict]:
    """(unsharded THD batch from the reference, this rank's expected result)."""
    golden = ref.thd_batch(full, spec.padding_token_id, spec.num_chunks, SENTINEL)
    expected = dict(golden)
    if spec.num_chunks == 1:
        bounds = golden["cu_seqlens_padded"].tolist()
        for k in THD_TOKEN_KEYS:
            expected[k] = _thd_local(golden[k], bounds, cp, r)
        return golden, expected
    for k, fill in THD_TOKEN_KEYS.items():
        rows = []
        for c in range(spec.num_chunks):
            bounds = [int(v) for v in golden["cu_seqlens_padded"][c] if v != SENTINEL]
            rows.append(_thd_local(golden[k][c][: bounds[-1]], bounds, cp, r))
        longest = max(t.shape[0] for t in rows)
        fill = spec.padding_token_id if fill is None else fill
        expected[k] = torch.stack(
            [torch.cat([t, torch.full((longest - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)]) for t in rows]
        )
    return golden, expected


def _thd_properties(spec: ThdSpec):
    def properties(ctx, full, local, outs):
        got = outs[0]
        cp, r = ctx.size("cp"), ctx.rank("cp")
        golden, expected = _thd_expected(spec, full, cp, r)
        props = [Property("qkv_format", got.get("qkv_format") == "thd", None, f"got {got.get('qkv_format')!r}")]
        for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", *THD_TOKEN_KEYS):
            props.append(_equal(k, got.get(k), expected[k]))
        if spec.num_chunks == 1 and cp > 1:  # the rank pieces reassembled = the unsharded batch
            props += _reassembled(ctx, got, golden, cp)
        return props

    return properties


def _reassembled(ctx, got: dict, golden: dict, cp: int) -> list[Property]:
    bounds = golden["cu_seqlens_padded"].tolist()
    props = []
    for k in THD_TOKEN_KEYS:
        mine = got.get(k)
        if not isinstance(mine, torch.Tensor) or mine.shape[0] * cp != golden[k].shape[0]:
            props.append(Property(f"reassembled:{k}", False, None, f"local {k} cannot be a 1/{cp} piece"))
            continue
        pieces = [torch.empty_like(mine) for _ in range(cp)]
        dist.all_gather(pieces, mine.contiguous(), group=ctx.group("cp"))
        whole = torch.empty_like(golden[k])
        for rank, piece in enumerate(pieces):
            index = torch.cat([a + head_tail(b - a, cp, rank) for a, b in zip(bounds[:-1], bounds[1:])])
            whole[index] = piece.cpu()
        props.append(_equal(f"reassembled:{k}", whole, golden[k], " (all ranks' pieces put back)"))
    return props


THD_SPECS = (
    # two rows; uneven real vs padded lengths, a sentinel pack, real tokens equal to the padding id
    ThdSpec("packs-sentinel", lens=(((5, 8), (16, 16)), ((16, 16), (3, 8), (SENTINEL, SENTINEL))), s=24),
    ThdSpec(
        "positions-pad3",
        lens=(((7, 8), (9, 16)), ((24, 24), (SENTINEL, SENTINEL))),
        s=24,
        padding_token_id=3,
        positions=True,
    ),
    ThdSpec("single", lens=(((16, 16),),), s=16),
    # num_chunks 2: chunks of 3 and 2 sequences (ragged cu_seqlens), 32 and 24 tokens
    ThdSpec(
        "chunks2",
        lens=(
            ((8, 8), (6, 8)),
            ((13, 16), (SENTINEL, SENTINEL)),
            ((16, 16), (SENTINEL, SENTINEL)),
            ((1, 8), (SENTINEL, SENTINEL)),
        ),
        s=16,
        num_chunks=2,
    ),
    ThdSpec("embeds", lens=(((10, 16),), ((8, 8), (2, 8))), s=16, embeds=3),
    ThdSpec("direct", lens=(((5, 8), (16, 16)), ((16, 16), (3, 8), (SENTINEL, SENTINEL))), s=24, direct=True),
    ThdSpec(
        "use-te",
        lens=(((5, 8), (16, 16)), ((16, 16), (3, 8), (SENTINEL, SENTINEL))),
        s=24,
        padding_token_id=2,
        use_te=True,
    ),
)


# Scale: packs of 32 and 64 tokens split head-tail up to CP 16 (the packs above, of 8 and 16, up to CP 4 and 8).
SCALE_THD_SPECS = (
    ThdSpec("scale-packs", lens=(((21, 32), (64, 64)), ((32, 32), (SENTINEL, SENTINEL))), s=96),
    ThdSpec("scale-chunks2", lens=(((30, 32), (32, 32)), ((64, 64), (SENTINEL, SENTINEL))), s=64, num_chunks=2),
    ThdSpec("scale-direct", lens=(((5, 32), (64, 64)),), s=96, padding_token_id=2, direct=True),
)


def _scale_cp(topo) -> bool:
    """CP 8 and up only, where the matrix's packs cannot be split: the default 1/2/4 run does not grow."""
    return _single_dp(topo) and topo.cp >= 8


def thd_case(spec: ThdSpec) -> Case:
    op = (
        "_shard_thd_chunk_for_te" if spec.direct else "make_cp_batch_and_ctx" if spec.use_te else "make_cp_batch_for_te"
    )
    return Case(
        op=OP + op,
        case_id=spec.name,
        params=spec.params,
        make_inputs=_thd_inputs(spec),
        reference=lambda x: (),
        run=_thd_run(spec),
        output_layouts=(),
        output_names=(),
        properties=_thd_properties(spec),
        dtypes=("float64",),
        context_parallel=True,
        supports=_scale_cp if spec in SCALE_THD_SPECS else _cp_only if spec.use_te else _single_dp,
        # each pack is split head-tail at its padded length
        cp_lengths=tuple(sorted({p for row in spec.lens for _, p in row if p != SENTINEL})),
    )


# ---- bad input -------------------------------------------------------------------------------


def _bad_step_batch(kind: str):
    """kind "both": input_ids and inputs_embeds; "neither": labels only."""

    def run(impl, ctx, x):
        batch = {"labels": x["labels"].clone()}
        if kind == "both":
            batch["input_ids"] = x["input_ids"].clone()
            batch["inputs_embeds"] = x["inputs_embeds"].clone()
        train_ctx, _ = impl.make_cp_batch_and_ctx(ctx.mesh, batch)
        with train_ctx():
            pass

    return run


def _bad_ctx(rotate, s: int):
    def run(impl, ctx, x):
        buf = x["input_ids"][:, :s].clone()
        with impl.create_context_parallel_ctx(ctx.mesh["cp"], [buf], [1], set(), cp_rotate_method=rotate):
            pass

    return run


def _bad_thd(drop: str = "", qkv_format: str = "thd", num_chunks: int = 1, padded: int = 8):
    def run(impl, ctx, x):
        batch = {
            "input_ids": x["input_ids"][:3].clone(),
            "labels": x["labels"][:3].clone(),
            "seq_lens": torch.tensor([[4], [padded], [5]]),
            "seq_lens_padded": torch.tensor([[8], [padded], [8]]),
        }
        batch.pop(drop, None)
        return impl.make_cp_batch_for_te(
            ctx.mesh["cp"], batch, qkv_format=qkv_format, num_chunks=num_chunks, seq_lens_padding_value=SENTINEL
        )

    return run


def _bad_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 9, (4, 16), generator=gen),
        "labels": torch.randint(0, 9, (4, 16), generator=gen),
        "inputs_embeds": torch.randn((4, 16, 4), generator=gen, dtype=torch.float64),
    }


@dataclass(frozen=True)
class BadSpec:
    """One input outside an op's contract (the ValueError / KeyError cases of docs/ops/cp_utils.md): the op must raise,
    any exception (only make_cp_batch_for_te's seed documents the types: ValueError for qkv_format, KeyError for missing
    keys)."""

    op: str
    case_id: str
    what: str  # the bad input, in words
    run: Callable
    supports: Callable
    documented: tuple[type[BaseException], ...] = ()


BAD_SPECS = (
    BadSpec(
        "make_cp_batch_and_ctx", "ids-and-embeds", "both input_ids and inputs_embeds", _bad_step_batch("both"), _cp_only
    ),
    BadSpec(
        "make_cp_batch_and_ctx",
        "neither-ids-nor-embeds",
        "neither input_ids nor inputs_embeds",
        _bad_step_batch("neither"),
        _cp_only,
    ),
    BadSpec(
        "create_context_parallel_ctx", "rotate-method-ring", 'cp_rotate_method "ring"', _bad_ctx("ring", 16), _single_dp
    ),
    BadSpec(
        "make_cp_batch_for_te",
        "qkv-format-bshd",
        'qkv_format "bshd"',
        _bad_thd(qkv_format="bshd"),
        _single_dp,
        documented=(ValueError,),
    ),
    BadSpec(
        "make_cp_batch_for_te",
        "missing-seq-lens",
        "a batch without seq_lens",
        _bad_thd(drop="seq_lens"),
        _single_dp,
        documented=(KeyError,),
    ),
    BadSpec(
        "make_cp_batch_for_te",
        "missing-seq-lens-padded",
        "a batch without seq_lens_padded",
        _bad_thd(drop="seq_lens_padded"),
        _single_dp,
        documented=(KeyError,),
    ),
    BadSpec(
        "make_cp_batch_for_te",
        "padded-6-not-divisible",
        "a padded length of 6, not divisible by 2·CP",
        _bad_thd(padded=6),
        _cp_only,
    ),
    BadSpec(
        "make_cp_batch_for_te", "batch-3-num-chunks-2", "3 rows in num_chunks 2", _bad_thd(num_chunks=2), _single_dp
    ),
)


def bad_input_case(spec: BadSpec) -> Case:
    return Case(
        op=OP + spec.op,
        case_id=spec.case_id,
        params={"bad_input": spec.what},
        make_inputs=_bad_inputs,
        reference=lambda x: (),
        run=spec.run,
        bad_input=BadInput(
            spec.what, documented=spec.documented, rule=SEED_RAISES.get(spec.documented[0]) if spec.documented else None
        ),
        dtypes=("float64",),
        context_parallel=True,
        supports=spec.supports,
    )


def unpadded_ctx_case() -> Case:
    """The training step through create_context_parallel_ctx on 10 tokens, which 2·CP does not divide: the op raises,
    or pads its buffers on the right as make_cp_batch_and_ctx does (ids and positions 0, loss_mask 0) and computes the
    loss and gradients of the real tokens exactly (causal attention: no real token sees a padded one)."""
    spec = StepSpec("ctx", s=10, rotate="allgather")
    case = step_case(spec, dtypes=("float64",))
    case.case_id, case.params, case.comm, case.supports = "seq-10-not-divisible", spec.params, None, _cp_only
    case.cp_lengths = ()  # the length 2·CP does not divide is the point of the case
    case.bad_input = BadInput(
        "a sequence of 10 tokens, not divisible by 2·CP",
        interpretation="buffers padded on the right: the loss and gradients of the real tokens",
    )
    return case


def bad_input_cases() -> list[Case]:
    cases = [bad_input_case(s) for s in BAD_SPECS]
    return cases[:3] + [unpadded_ctx_case()] + cases[3:]


DOC = "docs/ops/cp_utils.md"
_SHARDED = seed(
    "make_cp_batch_and_ctx: 'The batch has also been passed to create_context_parallel_ctx and is accordingly sharded.'"
)
# Where each property's rule comes from (docs/ops/cp_utils.md#rules-seed-or-ours lists them).
RULES = {
    "property:noop:*": seed(
        "make_cp_batch_and_ctx: 'If the input device_mesh is None or the size of the "
        "context_parallel submesh is 1, this function is effectively a no-op.'"
    ),
    "property:inside:*": _SHARDED,
    # the seed does not say that attention_mask goes (a mask sharded with the rest is "accordingly sharded" too); one
    # kept whole breaks the seed's "accordingly sharded" as well, and its Property cites that (_mask_dropped)
    "property:attention_mask_dropped": ours(f"{DOC}#make_cp_batch_and_ctx"),
    "property:after:*": seed(
        "create_context_parallel_ctx: 'cp_no_restore_buffers (Set[torch.Tensor]) – The no restore "
        "buffers for context parallel.' (the others are restored)"
    ),
    "property:created:*": ours(f"{DOC}#create_context_parallel_ctx"),
    "property:sdpa_*": ours(f"{DOC}#create_context_parallel_ctx"),
    "property:built": seed("_build_position_ids: 'Add position_ids to the batch only if they are missing.'"),
    "property:kept": seed("_build_position_ids: 'Add position_ids to the batch only if they are missing.'"),
    "property:qkv_format": seed("make_cp_batch_for_te returns 'qkv_format: Format string (“thd”)'"),
    "property:reassembled:*": seed(
        "make_cp_batch_for_te: 'Shards each chunk across CP ranks using Transformer Engine’s partitioning'"
    ),
    "property:padding_mask": seed(
        "make_cp_batch_for_te returns 'padding_mask: Boolean mask indicating padding tokens'"
    ),
    "property:position_ids": seed("make_cp_batch_for_te returns 'position_ids: Generated and sharded position IDs'"),
    # the THD batch's other keys, compared with ours: the seed lists them and what each holds
    "property:*": seed("make_cp_batch_for_te returns 'Processed batch in THD format with the following keys: ...'"),
}
SEED_RAISES = {
    ValueError: seed("make_cp_batch_for_te: 'Raises: ValueError – If qkv_format is not “thd”'"),
    KeyError: seed(
        "make_cp_batch_for_te: 'Raises: KeyError – If required fields (seq_lens, "
        "seq_lens_padded) are missing from batch'"
    ),
}


def cases(quick: bool = False) -> list[Case]:
    if quick:
        out = (
            [step_case(s) for s in QUICK_STEP_SPECS]
            + layout_cases()[:2]
            + [thd_case(THD_SPECS[0]), thd_case(THD_SPECS[3])]
            + bad_input_cases()[2:4]
            + [thd_case(s) for s in SCALE_THD_SPECS[:2]]
        )
    else:
        out = (
            [step_case(s) for s in STEP_SPECS]
            + layout_cases()
            + [thd_case(s) for s in THD_SPECS + SCALE_THD_SPECS]
            + bad_input_cases()
        )
    # input the seed does not describe (both ids and embeddings, a ring rotation, lengths 2·CP does not divide)
    return cite(out, RULES, bad_input=ours(f"{DOC}#make_cp_batch_and_ctx"))


# ---- benchmarks (`shardcheck run --bench`) -------------------------------------------------
#
# The CP attention step (make_cp_batch_and_ctx, all-gather rotation) against the single-device step:
# B = 1, S = 1024 / 2048 / 4096, hidden 64 (2 heads of 32), V = 256, at cp 1, 2, 4 (dp = tp = 1).
# At cp 1 the op is a no-op and the step is the plain one (torch's own SDPA); at size 1 the worker
# also runs the reference on the same inputs.  Per-rank peak live bytes should shrink ~1/CP.


def bench_case(s: int, via: str = "batch", rotate: str = "allgather", hidden: int = 64, vocab: int = 256) -> Case:
    """The step at sequence length s: via make_cp_batch_and_ctx (all-gather rotation), or via
    create_context_parallel_ctx with `rotate`; at cp 1, 2, 4 (dp = tp = 1)."""
    spec = StepSpec(via, b=1, s=s, hidden=hidden, vocab=vocab, rotate=rotate, loss_mask=False, tag="bench")
    case = step_case(spec, dtypes=("float32", "float64", "bfloat16"))
    case.case_id = f"bench-{via}-{rotate}-S{s}-h{hidden}-v{vocab}"
    case.params = {**spec.params, "sweep": "S", "tokens": s}
    case.supports = lambda t: t.dp == 1 and t.tp == 1
    return case


def bench_cases(quick: bool = False) -> list[Case]:
    if quick:
        return [bench_case(s, hidden=16, vocab=32) for s in (64, 128)]
    return [
        bench_case(s, via, rotate)
        for via, rotate in (("batch", "allgather"), ("ctx", "alltoall"))
        for s in (1024, 2048, 4096)
    ]


# ---- fuzz spaces (`shardcheck fuzz`) -----------------------------------------------------------------
#
# The training step through both entries (sizes, padding to 2·CP, ids or trainable embeddings, given / mRoPE
# positions, masks, both rotations) and the THD conversion (rows of packed sequences of random real and padded
# lengths, absent packs, rows that do not fill S, num_chunks, pad ids equal to real ids).  `_build_position_ids`
# has no space: its one parameter is S, and its two cases (missing, present) are the whole of its behaviour.


def _step_params(draw, st, topology: list[int], via: str) -> dict:
    dp, cp = topology[0], topology[1]
    if via == "batch":  # any S: the op pads it to a multiple of 2·CP
        s = draw(st.integers(2, 20))
        rotate, embeds = "allgather", draw(st.booleans())
        positions = draw(st.sampled_from(["none", "given", "mrope"]))
        attention_mask = draw(st.booleans())
    else:  # the caller's buffers go in as they are: S a multiple of 2·CP
        s = 2 * cp * draw(st.integers(1, 4))
        rotate, embeds, positions, attention_mask = (
            draw(st.sampled_from(["allgather", "alltoall"])),
            False,
            "none",
            False,
        )
    return {
        "via": via,
        "B": dp * draw(st.integers(1, 2)),
        "S": s,
        "hidden": draw(st.sampled_from([4, 8])),
        "V": draw(st.integers(2, 13)),
        "rotate": rotate,
        "inputs_embeds": embeds,
        "positions": positions,
        "loss_mask": draw(st.booleans()),
        "attention_mask": attention_mask,
    }


def _step_spec(p: dict) -> StepSpec:
    return StepSpec(
        p["via"],
        b=p["B"],
        s=p["S"],
        hidden=p["hidden"],
        vocab=p["V"],
        rotate=p["rotate"],
        embeds=p["inputs_embeds"],
        positions=p["positions"],
        loss_mask=p["loss_mask"],
        attention_mask=p["attention_mask"],
    )


def _thd_params(draw, st, cp: int, num_chunks: int) -> dict:
    """Rows of 1–3 packs, each padded to a multiple of 2·CP (1–3 tokens per chunk) with 1 to all of them real,
    sometimes an absent (sentinel) pack after them; S the longest row plus 0–3 tokens no pack covers."""
    rows = num_chunks * draw(st.integers(1, 4 // num_chunks))
    lens = []
    for _ in range(rows):
        row = []
        for _ in range(draw(st.integers(1, 3))):
            padded = 2 * cp * draw(st.integers(1, 3))
            row.append([draw(st.integers(1, padded)), padded])
        if draw(st.booleans()):
            row.append([SENTINEL, SENTINEL])
        lens.append(row)
    longest = max(sum(p for _, p in row if p != SENTINEL) for row in lens)
    return {
        "lens": lens,
        "S": longest + draw(st.integers(0, 3)),
        "padding_token_id": draw(st.integers(0, 3)),
        "num_chunks": num_chunks,
        "position_ids": draw(st.booleans()),
        "embeds": draw(st.sampled_from([0, 3])),
    }


def _thd_spec(p: dict, direct: bool = False, use_te: bool = False) -> ThdSpec:
    lens = tuple(tuple(tuple(pack) for pack in row) for row in p["lens"])
    return ThdSpec(
        "fuzz",
        lens=lens,
        s=p["S"],
        padding_token_id=p["padding_token_id"],
        num_chunks=p["num_chunks"],
        positions=p["position_ids"],
        embeds=p["embeds"],
        direct=direct,
        use_te=use_te,
    )


def _batch_params(topologies):
    """make_cp_batch_and_ctx: the training step on a padded, sharded batch, or (use_te) the THD conversion."""
    from hypothesis import strategies as st

    te_legal = any(_cp_only(t) for t in topologies)

    @st.composite
    def params(draw):
        use_te = draw(st.booleans()) if te_legal else False
        topology = draw(fuzz_topology(topologies, cp=True, legal=_cp_only if use_te else _cp_or_single))
        if use_te:
            return {"topology": topology, "dtype": "float64", "use_te": True, **_thd_params(draw, st, topology[1], 1)}
        return {
            "topology": topology,
            "dtype": draw(st.sampled_from(DTYPES)),
            "use_te": False,
            **_step_params(draw, st, topology, "batch"),
        }

    return params()


def _batch_case(p: dict) -> Case:
    return thd_case(_thd_spec(p, use_te=True)) if p["use_te"] else step_case(_step_spec(p))


def _ctx_params(topologies):
    """create_context_parallel_ctx + get_train_context: the step on the caller's own buffers, both rotations."""
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_cp_or_single))
        return {"topology": topology, "dtype": draw(st.sampled_from(DTYPES)), **_step_params(draw, st, topology, "ctx")}

    return params()


def _thd_space_params(topologies, chunks: bool):
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_single_dp))
        num_chunks = draw(st.sampled_from([1, 2])) if chunks else 1
        return {"topology": topology, "dtype": "float64", **_thd_params(draw, st, topology[1], num_chunks)}

    return params()


def fuzz_spaces() -> list[FuzzSpace]:
    return [
        FuzzSpace(OP + "make_cp_batch_and_ctx", _batch_params, _batch_case),
        FuzzSpace(OP + "create_context_parallel_ctx", _ctx_params, lambda p: step_case(_step_spec(p))),
        FuzzSpace(
            OP + "make_cp_batch_for_te", lambda ts: _thd_space_params(ts, chunks=True), lambda p: thd_case(_thd_spec(p))
        ),
        FuzzSpace(
            OP + "_shard_thd_chunk_for_te",
            lambda ts: _thd_space_params(ts, chunks=False),
            lambda p: thd_case(_thd_spec(p, direct=True)),
        ),
    ]
