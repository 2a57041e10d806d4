"""cp_utils: the reference, the implementation's pieces without a launch, the suite on the real
implementation (CP 2 and 4, both rotate methods), and each broken implementation caught."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import BROKEN

from shardcheck.distributed_impl import cp_utils as impl
from shardcheck.harness.core.layout import head_tail_positions
from shardcheck.reference import cp_utils as ref

SENTINEL = -1000


# ---- the implementation's pieces, one process ---------------------------------------------------


@pytest.mark.parametrize("length, cp", [(8, 2), (16, 4), (12, 3), (4, 1)])
def test_head_tail_index_matches_the_harness_rule(length, cp):
    for r in range(cp):
        assert torch.equal(impl._head_tail_index(length, cp, r), head_tail_positions(length, cp, r))
    held = torch.cat([impl._head_tail_index(length, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(length))  # every position exactly once


def test_head_tail_index_rejects_lengths_not_divisible_by_2cp():
    with pytest.raises(ValueError, match="divisible by 2·CP = 4"):
        impl._head_tail_index(10, 2, 0)


def test_the_thd_helper_is_handed_a_thd_batch_as_its_callers_hand_it_one():
    """Issue 42: the suite handed _shard_thd_chunk_for_te the BSHD batch; upstream's (and ours) takes the batch
    make_cp_batch_for_te converted to THD (tokens [T], cu_seqlens_padded), as every caller of it does."""
    from types import SimpleNamespace

    from shardcheck.suites import cp_utils as suite

    spec = next(s for s in suite.THD_SPECS if s.direct)
    x = suite._thd_inputs(spec)(torch.Generator().manual_seed(0))
    handed = []
    stub = SimpleNamespace(_shard_thd_chunk_for_te=lambda batch, *args: handed.append(batch) or batch)
    suite._thd_run(spec)(stub, SimpleNamespace(mesh={"cp": None}), x)
    batch = handed[0]
    assert batch["input_ids"].dim() == 1 and "cu_seqlens_padded" in batch and "seq_lens" not in batch, batch.keys()
    assert torch.equal(batch["input_ids"], ref.thd_batch(x, spec.padding_token_id, 1, SENTINEL)["input_ids"])
    # ours keeps its rank's tokens of such a batch (one CP rank: all of them) and says its format
    assert impl._shard_thd_chunk_for_te(batch, None, "thd", SENTINEL, 0)["qkv_format"] == "thd"


def test_thd_partition_is_head_tail_per_sequence():
    cu_padded = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    got = impl._thd_partition_index(cu_padded, 2, 1)
    # sequences of 8, 16, 8: chunks of 2, 4, 2; rank 1 of 2 holds chunks 1 and 2 of each
    assert got.tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19, 26, 27, 28, 29]
    with pytest.raises(ValueError, match="not divisible by 2·CP = 4"):
        impl._thd_partition_index(torch.tensor([0, 6], dtype=torch.int32), 2, 0)


def test_merge_of_disjoint_key_blocks_is_full_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, 2, 5, 4), generator=gen, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v)
    out_a, lse_a = impl._block_forward(q, k[..., :2, :], v[..., :2, :], 0.5, causal=False)
    out_b, lse_b = impl._block_forward(q, k[..., 2:, :], v[..., 2:, :], 0.5, causal=False)
    out, lse = impl._merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, full, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, -1), rtol=1e-13, atol=1e-13)


def test_causal_block_masks_future_keys_and_never_nans():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn((1, 1, 6, 3), generator=gen, dtype=torch.float64) for _ in range(3))
    out, lse = impl._block_forward(q, k, v, 3**-0.5, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-13, atol=1e-13)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("block_elements", [1 << 15, 8, 5])
def test_block_forward_and_backward_in_row_blocks(monkeypatch, block_elements):
    """Scores are computed a few query rows at a time (bounded memory): same values and gradients
    as one causal SDPA, whatever the row block (5 elements: 1-row blocks of 6 keys)."""
    monkeypatch.setattr(impl, "BLOCK_ELEMENTS", block_elements)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn((2, 2, 6, 3), generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    dout = torch.randn((2, 2, 6, 3), generator=gen, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.7)
    expected.backward(dout)
    with torch.no_grad():
        out, lse = impl._block_forward(q, k, v, 0.7, causal=True)
        dq, dk, dv = impl._block_backward(q, k, v, out, lse, dout, (dout * out).sum(-1), 0.7, causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)
    for got, ref_grad in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, ref_grad, rtol=1e-12, atol=1e-13)


def test_rotate_method_and_rotation_visibility():
    assert impl._chunk_visibility(3, 0) == "full"
    assert impl._chunk_visibility(3, 3) == "causal"
    assert impl._chunk_visibility(0, 3) == "none"


def test_no_mesh_or_cp1_is_a_noop():
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    factory, out = impl.make_cp_batch_and_ctx(None, batch)
    assert out is batch and "attention_mask" in out and "position_ids" not in out
    with factory():
        pass
    assert factory is contextlib.nullcontext


def test_build_position_ids_only_when_missing():
    batch = impl._build_position_ids({"input_ids": torch.zeros(2, 5, dtype=torch.long)}, "cpu")
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4]]
    given = torch.tensor([[4, 3, 2, 1, 0]])
    assert (
        impl._build_position_ids({"input_ids": torch.zeros(1, 5), "position_ids": given}, "cpu")["position_ids"]
        is given
    )


def test_get_train_context_enters_the_cp_context():
    entered = []

    @contextlib.contextmanager
    def cp_ctx():
        entered.append("cp")
        yield
        entered.append("exit")

    factory = impl.get_train_context(False, False, cp_ctx())
    with factory():
        assert entered == ["cp"]
    assert entered == ["cp", "exit"]


def test_thd_seed_example_and_padding_mask_by_position():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "labels": torch.tensor([[2, 3, 4, 5]]),
        "seq_lens": torch.tensor([[4]]),
        "seq_lens_padded": torch.tensor([[4]]),
    }
    assert impl.make_cp_batch_for_te(None, batch)["input_ids"].shape == torch.Size([4])
    # real tokens equal to the padding id (0) stay unmasked; the pad positions past the real length are masked
    batch = {
        "input_ids": torch.tensor([[0, 5, 0, 0, 7, 0, 0, 0]]),
        "labels": torch.arange(8)[None],
        "seq_lens": torch.tensor([[3, 2, SENTINEL]]),
        "seq_lens_padded": torch.tensor([[4, 4, SENTINEL]]),
    }
    out = impl.make_cp_batch_for_te(None, batch, seq_lens_padding_value=SENTINEL)
    assert out["padding_mask"].tolist() == [False, False, False, True, False, False, True, True]
    assert out["cu_seqlens"].tolist() == [0, 3, 5] and out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 8]
    assert int(out["max_seqlen"]) == 4 and out["max_seqlen"].dtype == torch.int32
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    for key in ("input_ids", "labels", "position_ids", "padding_mask", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(out[key], ref.thd_batch(batch, seq_lens_padding_value=SENTINEL)[key]), key


def test_thd_bad_input():
    batch = {
        "input_ids": torch.zeros(3, 8, dtype=torch.long),
        "labels": torch.zeros(3, 8, dtype=torch.long),
        "seq_lens": torch.tensor([[8]] * 3),
        "seq_lens_padded": torch.tensor([[8]] * 3),
    }
    with pytest.raises(ValueError):
        impl.make_cp_batch_for_te(None, batch, qkv_format="bshd")
    with pytest.raises(ValueError, match="num_chunks"):
        impl.make_cp_batch_for_te(None, batch, num_chunks=2)
    with pytest.raises(KeyError):
        impl.make_cp_batch_for_te(None, {k: v for k, v in batch.items() if k != "seq_lens_padded"})


# ---- the reference --------------------------------------------------------------------------------


def _step_inputs(gen, b=2, s=6, h=4, v=7):
    params = {
        "embed": torch.randn((v, h), generator=gen, dtype=torch.float64),
        "pos_embed": torch.randn((s + 2, h), generator=gen, dtype=torch.float64),
        "wqkv": torch.randn((3 * h, h), generator=gen, dtype=torch.float64),
        "wo": torch.randn((h, h), generator=gen, dtype=torch.float64),
        "lm_head": torch.randn((v, h), generator=gen, dtype=torch.float64),
    }
    batch = {
        "input_ids": torch.randint(0, v, (b, s), generator=gen),
        "labels": torch.randint(0, v, (b, s), generator=gen),
        "loss_mask": torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 1, 0, 1, 1]]),
    }
    return params, batch


def test_reference_padding_changes_neither_loss_nor_gradients():
    """The golden runs unpadded; the CP step pads (labels -100, loss_mask 0): same loss, same gradients."""
    params, batch = _step_inputs(torch.Generator().manual_seed(2))
    n = ref.count_valid(batch["labels"], batch["loss_mask"])
    results = []
    for b in (batch, ref.padded_batch(batch, cp_size=2)):  # S = 6 -> 8
        ps = {k: p.clone().requires_grad_() for k, p in params.items()}
        loss = ref.attention_block_loss(ps, b, n, n_heads=2)
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in ps.items()}))
    assert ref.padded_batch(batch, 2)["labels"][:, 6:].eq(-100).all()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-14, atol=0)
    for k in params:
        torch.testing.assert_close(results[0][1][k], results[1][1][k], rtol=1e-12, atol=1e-14)


def test_reference_attention_mask_of_ones_is_causal():
    params, batch = _step_inputs(torch.Generator().manual_seed(3))
    n = ref.count_valid(batch["labels"], batch["loss_mask"])
    with_mask = ref.attention_block_loss(params, {**batch, "attention_mask": torch.ones(2, 6)}, n, 2)
    torch.testing.assert_close(with_mask, ref.attention_block_loss(params, batch, n, 2), rtol=1e-14, atol=0)


# ---- the suite's structure -------------------------------------------------------------------------


def test_quick_cases_cover_the_ops_and_both_rotations():
    from shardcheck.harness.core.topology import default_topologies
    from shardcheck.suites import cp_utils as suite

    quick = suite.cases(quick=True)
    assert {c.op for c in quick} == {
        "cp_utils.make_cp_batch_and_ctx",
        "cp_utils.create_context_parallel_ctx",
        "cp_utils.make_cp_batch_for_te",
    }
    rotations = {c.params.get("rotate") for c in quick if c.grad_inputs}
    assert rotations == {"allgather", "alltoall"}
    # the scale cases (CP 8 and 16 only) do not slow the quick run at 1/2/4
    assert (
        all(c.context_parallel for c in quick) and len([c for c in quick if not c.case_id.startswith("scale-")]) <= 10
    )
    assert all(not c.runs_on(t) for c in quick if c.case_id.startswith("scale-") for t in default_topologies([1, 2, 4]))
    full = suite.cases()
    assert len({(c.op, c.case_id) for c in full}) == len(full)
    assert sum(c.bad_input is not None for c in full) == 9


# ---- the suite on the real implementation ----------------------------------------------------------


def test_quick_suite_passes_at_cp_2_and_4(run_shardcheck):
    run = run_shardcheck("run", "--suite", "cp_utils", "--quick", "--world-sizes", "1,2,4", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    steps = rows[rows["check"].str.startswith("grad:")]
    assert {1, 2, 4} <= set(steps["cp"]) and {1, 2} <= set(steps["dp"])
    assert {"float64", "float32", "bfloat16"} <= set(steps["dtype"])
    assert {"grad:wqkv", "grad:inputs_embeds", "grad:embed"} <= set(steps["check"])
    for rotate in ("allgather", "alltoall"):
        sel = steps[steps["case_id"].str.contains(rotate)]
        assert {2, 4} <= set(sel["cp"]), rotate
    comm = rows[(rows["check"] == "property:comm") & (rows["cp"] == 4) & rows["case_id"].str.contains("alltoall")]
    assert len(comm) and all(c["forward"]["all_to_all@cp"] == 3 for c in comm["comm_calls"])  # CP − 1 exchanges
    thd = rows[rows["op"] == "cp_utils.make_cp_batch_for_te"]
    assert {"property:padding_mask", "property:reassembled:input_ids"} <= set(thd["check"])


# ---- broken implementations --------------------------------------------------------------------------

BROKEN_CASES = {  # name -> (case patterns to run, checks that must fail)
    "labels_padded_zero": (
        ["layout-b2s10-*", "batch-allgather-b2s10h8v11-ids-pos-given"],
        {"property:inside:labels", "forward"},
    ),
    # one bug, two symptoms in different items, so two findings lines (one root per line): the mask left in the batch
    # where the layout is inspected, and the step's attention failing on the unsharded mask
    "attention_mask_kept": (["layout-b2s10-*"], {"property:attention_mask_dropped"}),
    "attention_mask_kept:step": (["batch-allgather-b2s10h8v11-ids-pos-none-lossmask-attnmask"], {"forward"}),
    "ring_no_causal_between_blocks": (["ctx-*b2s16*"], {"forward", "grad:wqkv"}),
    "merge_in_float32": (["ctx-alltoall-b2s16*"], {"grad:wqkv"}),
    "thd_mask_by_token_id": (["packs-sentinel", "chunks2"], {"property:padding_mask"}),
    # create_context_parallel_ctx's no-restore buffer restored: the seed's rule; the batch's labels that
    # make_cp_batch_and_ctx passes it as no-restore restored too: which are no-restore is ours (a warn, under --impl)
    "restores_no_restore": (["layout-*"], {"property:after:kept"}),
}


@pytest.mark.parametrize("name", sorted(BROKEN_CASES))
def test_broken_implementation_is_caught(run_shardcheck, name):
    patterns, must_fail = BROKEN_CASES[name]
    args = [
        "run",
        "--suite",
        "cp_utils",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--timeout",
        "120",
        "--impl",
        f"cp_utils={BROKEN / 'cp_utils' / name.split(':')[0]}.py",
    ]
    for p in patterns:
        args += ["--case", p]
    run = run_shardcheck(*args)
    rows = run.rows
    if name == "merge_in_float32":
        # float64 computed in float32: a failure of the 1e-10 float64 check, or, where the harness
        # recognises the float32 signature, its own "warn" status (exit 0) -- flagged either way
        assert run.returncode in (0, 1), run.stdout + run.stderr
        flagged = rows[rows["status"].isin(["fail", "warn"])]
        assert must_fail <= set(flagged["check"]), rows[["case_id", "check", "status", "message"]]
        return
    assert run.returncode == 1, run.stdout + run.stderr
    bad = rows[rows["status"].isin(["fail", "error"])]
    assert must_fail <= set(bad["check"]), bad[["case_id", "check", "message"]]
    if name == "labels_padded_zero":  # 10 tokens padded to 12 at cp 2: rank 0 holds the two padded ones
        row = bad[bad["check"] == "property:inside:labels"].iloc[0]
        assert "expected -100, got 0" in row["message"]
    if name == "restores_no_restore":
        labels = rows[rows["check"] == "property:after:labels"]
        assert len(labels) and (labels["status"] == "warn").all() and (labels["rule_source"] == "ours").all(), labels
    if name == "attention_mask_kept":  # kept whole, not sharded with the rest: the seed's "accordingly sharded"
        kept = rows[rows["check"] == "property:attention_mask_dropped"]
        assert (kept["status"] == "fail").all() and (kept["rule_source"] == "seed").all(), kept
    if name == "ring_no_causal_between_blocks":  # rank 0 holds the first chunk: it sees future chunks
        assert (bad[bad["check"] == "forward"]["status"] == "fail").all()
