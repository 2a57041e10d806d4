"""model_utils on the CP axis: the suite passes on CP topologies (an 8-rank one included), and the harness
fails wrong CP implementations, naming the check, the rank and the global token position."""

from __future__ import annotations

import pytest
import torch
from helpers import BROKEN
from torch.distributed.tensor import Shard

from shardcheck.harness.core.layout import HeadTail, Layout, PackedHeadTail, Permuted, head_tail_positions


def test_layout_rules_map_positions():
    """The harness's own index rules, independent of the implementation under test."""
    sizes = {"dp": 1, "cp": 2, "tp": 1}

    def at(layout, shape, cp, inputs=None):
        return [ix.tolist() for ix in layout.indices(shape, {"cp": cp}, sizes, inputs)]

    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert at(Layout(cp=HeadTail(1)), (1, 16), 1)[1] == [4, 5, 6, 7, 8, 9, 10, 11]
    bounds = {"cu_seqlens_padded": torch.tensor([0, 8, 12])}
    assert at(Layout(cp=PackedHeadTail(1)), (1, 12), 0, bounds)[1] == [0, 1, 6, 7, 8, 11]
    perm = {"seq_index": torch.tensor([3, 0, 2, 1])}
    assert at(Layout(cp=Permuted(1)), (2, 4), 1, perm)[1] == [2, 1]
    # head-tail over CP, then contiguous SP over TP: rank (cp=1, tp=1) of cp2 x tp2 holds positions 8..11
    hidden = Layout(cp=HeadTail(0), tp=Shard(0))
    assert hidden.indices((16, 2), {"cp": 1, "tp": 1}, {"cp": 2, "tp": 2})[0].tolist() == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="divisible by 2·CP = 4"):
        head_tail_positions(6, 2, 0)


def test_cp_suite_passes_on_eight_ranks(run_shardcheck):
    """An 8-rank CP topology (CP 2 with TP 4), quick cases, every dtype."""
    run = run_shardcheck(
        "run", "--suite", "model_utils_cp", "--quick", "--topology", "dp=1,cp=2,tp=4", "--timeout", "300", timeout=900
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = run.rows
    assert (rows["status"] == "pass").all() and set(rows["cp"]) == {2} and set(rows["tp"]) == {4}
    assert {"float64", "float32", "bfloat16"} <= set(rows["dtype"])
    for op in (
        "from_parallel_logits_to_logprobs",
        "from_parallel_logits_to_logprobs_packed_sequences",
        "from_parallel_hidden_states_to_logprobs",
        "get_distillation_topk_logprobs_from_logits",
    ):
        grads = rows[(rows["op"] == f"model_utils.{op}") & rows["check"].str.startswith("grad:")]
        assert len(grads), op
        # every rank of the 8 reported its own gradient
        assert all(sorted(r["rank"] for r in pr) == list(range(8)) for pr in grads["per_rank"])


def _impl(name: str) -> tuple[str, str]:
    return ("--impl", f"model_utils={BROKEN / 'model_utils_cp' / name}.py")


CP2 = ("--suite", "model_utils_cp", "--topology", "dp=1,cp=2,tp=1", "--dtype", "float64", "--quick", "--timeout", "120")


@pytest.mark.parametrize(
    "module, ops, check, positions",
    [
        # chunk r after chunk 2·CP−1−r: the layout op, the log-probs and every op that lays out its ids through it
        (
            "swapped_chunks",
            {
                "_get_tokens_on_this_cp_rank",
                "from_parallel_logits_to_logprobs",
                "gather_logits_at_global_indices",
                "get_distillation_topk_logprobs_from_logits",
            },
            "forward",
            None,
        ),
        # the shift inside each shard: wrong exactly at the last position of a chunk (3 on rank 0, 11 on rank 1)
        ("shift_inside_shard", {"from_parallel_logits_to_logprobs"}, "forward", {3, 11}),
        # the gather's backward without the sum over CP ranks
        ("gather_backward_no_sum", {"allgather_cp_sharded_tensor", "AllGatherCPTensor"}, "grad:x", None),
        # head-tail over the whole pack instead of per sequence
        ("packed_whole_pack_head_tail", {"from_parallel_logits_to_logprobs_packed_sequences"}, "forward", None),
        # values right, gradient x CP
        ("grad_scaled_by_cp", {"from_parallel_logits_to_logprobs"}, "grad:logits", None),
    ],
)
def test_broken_cp_implementations_are_caught(run_shardcheck, module, ops, check, positions):
    run = run_shardcheck("run", *_impl(module), *CP2, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    bad = run.failed()
    assert set(bad["op"]) == {f"model_utils.{op}" for op in ops}, bad[["op", "check"]]
    assert (bad["status"] == "fail").all()  # wrong values, not crashes
    rows = bad[bad["check"] == check]
    assert len(rows), bad[["op", "check", "message"]]
    for _, row in rows.iterrows():
        m = row["mismatch"]
        assert m["rank"] in (0, 1) and m["coords"]["cp"] == m["rank"] and m["global_index"] is not None
        assert f"at global {tuple(m['global_index'])}" in row["message"] or "first at global" in row["message"]
        if positions is not None:  # the global token position named is one that really is wrong
            assert m["global_index"][1] in positions, row["message"]
    assert "FAIL" in run.stdout


def test_almost_one_hot_entropy_gradient(run_shardcheck):
    """The full-vocab distillation path's entropy gradient on almost one-hot rows (×100 logits, K = 1): ours
    passes; an implementation differentiating p log p by autograd gets 0 at each row's max and fails there."""
    case = (
        "--suite",
        "model_utils_cp",
        "--op",
        "model_utils.get_distillation_topk_logprobs_from_logits",
        "--case",
        "*v5-k1-*",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float32",
    )
    ours = run_shardcheck("run", *case)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    assert (ours.rows["status"] == "pass").all() and "grad:student_logits" in set(ours.rows["check"])

    broken = run_shardcheck("run", *_impl("entropy_through_autograd"), *case)
    assert broken.returncode == 1, broken.stdout[-3000:] + broken.stderr[-3000:]
    bad = broken.failed()
    assert set(bad["check"]) == {"grad:student_logits"} and (bad["status"] == "fail").all()
    m = bad.iloc[0]["mismatch"]
    assert m["got"] == 0 and m["expected"] != 0 and m["coords"]["cp"] == m["rank"]
