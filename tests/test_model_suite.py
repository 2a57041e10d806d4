"""The built-in model suite (`decoder`): a small decoder's training step over (dp, cp, tp) that calls the seed families
(cp_utils shards the batch, model_utils' vocab-parallel log-probs make the loss, distributed_utils.reduce_loss reduces
it over DP), each resolved by its own --impl.  Our modules pass at every topology of world sizes 1, 2, 4; a broken
seed module under --impl is one finding at the step that uses it (the loss; the embedding that reads the sharded
batch), named in run.json and reproduced alone by its rerun line."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from helpers import BROKEN

from shardcheck.harness.rank.suite_loader import load_suite, suite_cases
from shardcheck.reference import decoder as ref

RUN = ("run", "--suite", "decoder", "--dtype", "float64")
VOCAB_OFFSET = f"model_utils={BROKEN / 'model_utils' / 'wrong_vocab_offset.py'}"
CHUNKS_SWAPPED = f"cp_utils={BROKEN / 'cp_utils' / 'chunks_swapped.py'}"
# Runs more than one test asserts on (the `shared_run` fixture: once per session)
OURS = (*RUN, "--world-sizes", "1,2,4")
SWAPPED = (*RUN, "--topology", "dp=1,cp=2,tp=1", "--topology", "dp=1,cp=1,tp=2", "--impl", CHUNKS_SWAPPED)


def _one_cause(run):
    table = run.causes
    assert len(table) == 1, run.stdout[-3000:]
    return table.iloc[0]


# ---- without ranks -------------------------------------------------------------------------------------------------


def test_the_suite_is_a_model_case_that_uses_the_seed_families():
    (case,) = suite_cases("decoder", quick=False)
    assert case.op == "decoder.parallelize" and set(case.uses) == {"cp_utils", "model_utils", "distributed_utils"}
    names = case.output_names
    assert names[0] == "act00:tok_embeddings" and "loss" in names and "step:output.weight" in names
    assert case.context_parallel  # cp_utils shards the whole sequences itself
    assert load_suite("decoder").FAMILY == "decoder"


def test_rotary_positions_given_equal_the_offset_ones():
    rope = ref.Rotary(4)
    x = torch.randn(2, 6, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    by_offset = rope(x, 5)
    by_ids = rope(x, position_ids=torch.arange(5, 11).expand(2, -1))
    torch.testing.assert_close(by_ids, by_offset, rtol=0, atol=0)
    # a head-tail piece: positions not contiguous, each row still rotated by its own position
    pos = torch.tensor([0, 1, 4, 5])
    torch.testing.assert_close(rope(x[:, pos], position_ids=pos[None]), rope(x)[:, pos], rtol=0, atol=1e-15)


def test_the_reference_loss_is_the_mean_next_token_nll():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 7, (2, 5), generator=gen)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(ref.loss(logits, tokens), want)


# ---- runs ----------------------------------------------------------------------------------------------------------


def test_every_topology_of_world_sizes_1_2_4_passes(shared_run):
    run = shared_run(*OURS)
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    topologies = set(zip(rows["dp"], rows["cp"], rows["tp"]))
    assert topologies == {
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
        (1, 1, 2),
        (4, 1, 1),
        (1, 4, 1),
        (1, 1, 4),
        (2, 2, 1),
        (2, 1, 2),
        (1, 2, 2),
    }
    assert {
        "forward:loss",
        "forward:act00:tok_embeddings",
        "forward:dparam:layers.1.attention.wq.weight",
        "forward:step:norm.weight",
    } <= set(rows["check"])
    impl = json.loads((run.out / "run.json").read_text())["impl"]
    assert impl["model_utils"] == "shardcheck.distributed_impl.model_utils"
    assert impl["cp_utils"] == "shardcheck.distributed_impl.cp_utils"
    assert impl["distributed_utils"] == "shardcheck.distributed_impl.distributed_utils"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_passes_with_cp_and_tp(run_shardcheck, dtype):
    run = run_shardcheck(
        "run", "--suite", "decoder", "--dtype", dtype, "--topology", "dp=1,cp=2,tp=2", "--topology", "dp=2,cp=2,tp=1"
    )
    assert run.returncode == 0, run.stdout[-3000:]


def test_a_wrong_vocab_offset_in_model_utils_is_found_at_the_loss(run_shardcheck):
    run = run_shardcheck(*RUN, "--topology", "dp=1,cp=1,tp=2", "--topology", "dp=2,cp=1,tp=1", "--impl", VOCAB_OFFSET)
    assert run.returncode == 1
    cause = _one_cause(run)
    assert cause.checks.startswith("first diverging: the loss [forward:loss]"), cause.checks
    assert "dp1-cp1-tp2" in cause.worst and set(run.failed()["tp"]) == {2}  # one TP rank: no vocab offset to get wrong
    assert not (run.failed()["check"].str.startswith("forward:act")).any()  # the forward agrees up to the loss
    impl = json.loads((run.out / "run.json").read_text())["impl"]
    assert impl["model_utils"].endswith("wrong_vocab_offset.py") and impl["decoder"].endswith(
        "distributed_impl.decoder"
    )
    assert (
        f"modules under test: cp_utils=shardcheck.distributed_impl.cp_utils, decoder=shardcheck.distributed_impl"
        f".decoder, distributed_utils=shardcheck.distributed_impl.distributed_utils, {VOCAB_OFFSET}" in run.stderr
    )
    assert "- modules under test: cp_utils=" in (run.out / "report.md").read_text()
    assert f"--impl {VOCAB_OFFSET}" in cause.rerun
    again = run_shardcheck(*shlex.split(cause.rerun)[1:])
    assert again.returncode == 1 and _one_cause(again).checks.startswith("first diverging: the loss")
    assert set(zip(again.rows["dp"], again.rows["cp"], again.rows["tp"])) == {(1, 1, 2)}


def test_swapped_cp_chunks_in_cp_utils_are_found_at_the_embedding(shared_run, run_shardcheck):
    run = shared_run(*SWAPPED)
    assert run.returncode == 1
    cause = _one_cause(run)
    assert cause.checks.startswith(
        "first diverging: module tok_embeddings (output, forward) [forward:act00:tok_embeddings]"
    ), cause.checks
    assert "cp=1" in cause.worst or "cp=0" in cause.worst
    assert set(run.failed()["cp"]) == {2}  # without CP the batch is never sharded by it
    assert f"--impl {CHUNKS_SWAPPED}" in cause.rerun
    again = run_shardcheck(*shlex.split(cause.rerun)[1:])
    assert again.returncode == 1 and _one_cause(again).checks.startswith("first diverging: module tok_embeddings")


def test_an_impl_of_a_used_family_that_does_not_import_is_one_usage_line(run_shardcheck, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ImportError('nope')\n")
    run = run_shardcheck(*RUN, "--topology", "dp=1,cp=1,tp=1", "--impl", f"model_utils={bad}")
    assert run.returncode == 2
    assert "--impl model_utils=" in run.stderr and "cannot import" in run.stderr and "Traceback" not in run.stderr


def test_a_drifted_signature_of_a_function_the_step_calls_is_the_model_cases_finding(run_shardcheck):
    # make_cp_batch_and_ctx drifted (keyword-only) and make_cp_batch_for_te too, which the step never calls
    drifted = f"cp_utils={BROKEN / 'cp_utils' / 'make_cp_batch_keyword_only.py'}"
    run = run_shardcheck(*RUN, "--topology", "dp=1,cp=2,tp=1", "--topology", "dp=1,cp=1,tp=2", "--impl", drifted)
    assert run.returncode == 1
    cause = _one_cause(run)
    assert cause.op == "decoder.parallelize" and cause.checks == "property:signature"
    assert cause.kind.startswith(
        "rank 0 (dp=0, cp=0, tp=0): cp_utils.make_cp_batch_and_ctx: signature: "
        "keyword-only parameter(s) the seed takes by position: loss_mask, use_te"
    ), cause.kind
    assert "make_cp_batch_for_te" not in cause.kind and "before any case ran" not in cause.condition
    rows = run.rows
    signature = rows[rows["check"] == "property:signature"]
    assert list(signature["status"]) == ["fail", "fail"] and set(signature["case_id"]) == {"step"}
    assert (rows.loc[rows["check"] != "property:signature", "status"] == "pass").all()  # called by keyword: right
    again = run_shardcheck(*shlex.split(cause.rerun)[1:])
    assert again.returncode == 1 and _one_cause(again).checks == "property:signature"
    # the op selected too: its own signature row, before any case, is the one line (not the model's as well)
    both = run_shardcheck(
        "run",
        "--op",
        "cp_utils.make_cp_batch_and_ctx,decoder.parallelize",
        "--quick",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--impl",
        drifted,
    )
    assert both.returncode == 1 and _one_cause(both).op == "cp_utils.make_cp_batch_and_ctx"


def test_rows_name_every_used_module_and_a_matching_signature_passes(shared_run):
    run = shared_run(*SWAPPED)
    rows = run.rows
    rows = rows[(rows["cp"] == 2) & (rows["tp"] == 1)]  # (the run's CP 2 topology: the one that calls cp_utils)
    assert len(rows)
    assert list(rows.loc[rows["check"] == "property:signature", "status"]) == ["pass"]
    # `impl` is the case's own family's module; `uses_impl` every used family's, on every row of the item
    swapped = CHUNKS_SWAPPED.split("=", 1)[1]
    used = {
        "cp_utils": swapped,
        "model_utils": "shardcheck.distributed_impl.model_utils",
        "distributed_utils": "shardcheck.distributed_impl.distributed_utils",
    }
    assert set(rows["impl"]) == {"shardcheck.distributed_impl.decoder"}
    assert all(u == used for u in rows["uses_impl"]), rows["uses_impl"].iloc[0]
    report = (run.out / "report.md").read_text()
    assert (
        f"- decoder.parallelize (its own decoder=shardcheck.distributed_impl.decoder) calls cp_utils={swapped}, "
        "distributed_utils=shardcheck.distributed_impl.distributed_utils, "
        "model_utils=shardcheck.distributed_impl.model_utils"
    ) in report
    ours = shared_run(*OURS)  # our own modules: nothing to compare, at CP 2 or anywhere
    assert ours.returncode == 0 and (ours.rows["cp"] == 2).any() and "property:signature" not in set(ours.rows["check"])
