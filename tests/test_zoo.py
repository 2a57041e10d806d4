"""The field bug zoo (zoo/, `shardcheck zoo`, docs/zoo.md): every pair at its topology in one run, as CI runs it.

Each entry whose bug needs nothing the harness lacks must be caught at step 1 on its broken case, by a finding that
names what the thread's fix touched, and its fixed twin must pass in float64, float32 and bfloat16; an entry that
needs a capability of another branch is counted missed with the reason, and only a capability still missing may be
listed (none is today: the HSDP and micro-batch pairs pytorch_155903, verl_7493, nemo_12210, transformers_34191 and
the expert-parallel pairs megatron_lm_1628, megatron_lm_5956 waited for capabilities that have landed).
Batch invariance (shardcheck.batch_invariance) is tested here too: without ranks on a row-local op and a
position-dependent one, and through its zoo pair (NeMo-RL#1227), where only it sees the bug.  The seven op pairs
whose finding is their one output (`forward`) show the rank, element or error where the harness can say it
(`Bug.shows`), and say why not in their docstring where it cannot."""

from __future__ import annotations

import ast
import json
import math
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from helpers import ROOT, cli

from shardcheck import batch_invariance
from shardcheck.harness.driver.zoo import entries, run_argv, zoo_dir

ZOO = ROOT / "zoo"
EP_PAIRS = ("megatron_lm_1628", "megatron_lm_5956")  # on issue 39's ep axis and MoE family


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "run"
    proc = cli("zoo", "--out", str(out), timeout=600)
    return proc, json.loads((out / "zoo.json").read_text()), out


def test_the_zoo_is_the_checkouts_folder_and_every_entry_cites_its_thread():
    assert zoo_dir() == ZOO
    found = entries(ZOO)
    assert len(found) >= 20
    for entry in found:
        bug = entry.bug
        assert "#" in bug.thread and bug.url.startswith("https://github.com/"), entry.name
        assert bug.symptom and bug.time_to_find and bug.fix and bug.names, entry.name


def test_one_run_holds_every_pair_each_at_its_topology(tmp_path):
    runnable = [e for e in entries(ZOO) if e.bug.needs is None]
    argv = run_argv(ZOO, runnable, tmp_path)
    assert argv.count("--suite") == len(runnable) and argv[0] == "run"
    assert {argv[i + 1] for i, a in enumerate(argv) if a == "--topology"} == {e.bug.topology for e in runnable}


def test_every_pair_is_caught_at_step_one_named_right_and_its_twin_passes(zoo_run):
    proc, table, out = zoo_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = {b["entry"]: b for b in table["bugs"]}
    assert set(lines) == {e.name for e in entries(ZOO)}
    for entry in entries(ZOO):
        line = lines[entry.name]
        if entry.bug.needs is not None:
            assert not line["caught"] and line["missed"] == f"needs {entry.bug.needs}", line
            continue
        assert line["caught"] and line["step"] == 1, line
        assert line["named"], line
        assert line["false_alarm"] == "", line
    summary = table["summary"]
    assert summary["false_alarms"] == 0
    assert summary["caught_at_step_1"] == sum(e.bug.needs is None for e in entries(ZOO))
    md = (out / "zoo.md").read_text()
    assert "`shardcheck zoo`" in md and md.count("\n| ") == len(lines) + 1  # the header, one line per bug


def test_named_right_means_the_subject_the_fix_touched(zoo_run):
    lines = {b["entry"]: b for b in zoo_run[1]["bugs"]}
    assert lines["megatron_lm_1446"]["finding"].startswith("first diverging: parameter norm.weight (gradient)")
    assert lines["automodel_2377"]["finding"].startswith("first diverging: module layers.0.attention.rope")
    assert lines["megatron_lm_906"]["finding"].startswith("first diverging: the loss")
    assert lines["transformer_engine_1557"]["finding"] == "grad:k, grad:v"  # dQ right, dK and dV wrong
    assert "output.weight" in lines["entrenar_314"]["finding"]  # the untied copy of the tied weight
    # HSDP: the replicas' gradients averaged once too often (pytorch#155903), never reduced (verl#7493)
    for name in ("pytorch_155903", "verl_7493"):
        assert lines[name]["finding"].startswith("first diverging: parameter tok_embeddings.weight (gradient)"), name
    # micro-batches: the per-micro-batch mean (Transformers 2024), the CP attention at two rows per micro-batch
    assert lines["transformers_34191"]["finding"].startswith("first diverging: the loss")
    assert lines["nemo_12210"]["finding"].startswith("first diverging: module layers.0.attention.")
    # expert parallelism: the experts' gradients synced over the dense group (Megatron-LM#1628), ep times too large
    # (Megatron-LM PR #5956); the dense ones right in both
    for name in EP_PAIRS:
        assert lines[name]["finding"].startswith("first diverging: parameter layer.moe.experts.w1 (gradient)"), name


# The op pairs whose failing checks are only their one output (`forward`): where the harness says more (the rank, the
# element, the error), their BUG.shows holds it; where it cannot, their docstring says why ("and no more").
FORWARD_ONLY = (
    "bionemo_recipes_631",
    "megatron_lm_1754",
    "megatron_lm_7452_gathered_logits",
    "megatron_lm_7464",
    "skyrl_1420",
    "torchtitan_3280",
    "torchtitan_596",
)
WORST = re.compile(
    r"^rank (?P<rank>\d+) .* at global \((?P<index>[\d, ]*)\) .*: expected (?P<expected>\S+), got (?P<got>\S+); "
    r"failing rank\(s\): (?P<ranks>[\d, ]+)$"
)


def _worst(line: dict, check: str) -> dict:
    found = WORST.match(line["worst"][check])
    assert found, line["worst"][check]
    index = [int(i) for i in found["index"].split(", ") if i]
    return {
        "rank": int(found["rank"]),
        "index": index,
        "expected": float(found["expected"]),
        "got": float(found["got"]),
        "ranks": found["ranks"],
    }


def test_each_forward_only_op_pair_shows_more_or_says_why_not():
    by_name = {e.name: e for e in entries(ZOO)}
    assert sorted(n for n, e in by_name.items() if e.bug.names == ("forward",)) == list(FORWARD_ONLY)
    for name in FORWARD_ONLY:
        entry = by_name[name]
        doc = " ".join(ast.get_docstring(ast.parse(entry.path.read_text())).split())
        assert "Named right:" in doc, name
        assert bool(entry.bug.shows) != ("and no more" in doc), name  # shows more, or says why it cannot


def test_the_forward_only_op_pairs_name_the_rank_the_element_or_the_error(zoo_run):
    lines = {b["entry"]: b for b in zoo_run[1]["bugs"]}
    # padded vocabulary: the worst gradient is a padding column's, on the last TP rank, where the right one is 0
    for name, vocab in (("megatron_lm_1754", 30), ("bionemo_recipes_631", 33)):
        worst = _worst(lines[name], "grad:logits")
        assert worst["rank"] == 1 and worst["index"][-1] >= vocab and worst["expected"] == 0, (name, worst)
    # the TP-gathered logits: every token's loss plus log(TP)
    worst = _worst(lines["megatron_lm_7452_gathered_logits"], "forward")
    assert abs(worst["got"] - worst["expected"] - math.log(2)) < 1e-9
    # the rest cannot name a rank: every rank fails (a scalar on every rank; every element of every shard)
    assert _worst(lines["skyrl_1420"], "forward")["ranks"] == "0, 1, 2, 3"
    skyrl = _worst(lines["skyrl_1420"], "forward")
    assert abs(skyrl["got"] / skyrl["expected"] - 2) < 1e-9  # summed over CP 2 too: the values show it, unnamed
    assert _worst(lines["torchtitan_3280"], "forward")["ranks"] == "0, 1, 2, 3"
    assert _worst(lines["torchtitan_596"], "forward")["ranks"] == "0, 1"
    assert {_worst(lines["megatron_lm_7464"], c)["ranks"] for c in ("forward", "grad:logits")} == {"0, 1"}


def test_a_finding_that_does_not_show_what_the_bug_shows_is_not_named_right():
    from shardcheck.harness.core.zoo_bug import Bug
    from shardcheck.reports.zoo import _not_shown, _worst

    def bug(shows):
        return Bug(
            thread="o/r#3",
            url="https://github.com/o/r/issues/3",
            title="t",
            symptom="s",
            time_to_find="d",
            fix="f",
            topology="tp=2",
            names=("grad:logits",),
            shows=shows,
        )

    line = "rank 0 (dp=0, cp=0, tp=0): |err| 0.1 > budget 1e-10 at global (0, 3) (local (0, 3)): expected 0, got 0.1"
    rows = _rows("fail", {})
    rows = rows.assign(check=["grad:logits"], message=[line])
    step = rows.assign(check=["forward:dparam:w"], message=["a model step's: its finding names the parameter"])
    worst = _worst(pd.concat([rows, step]))
    assert worst == {"grad:logits": line}
    assert _not_shown(bug({"grad:logits": r"^rank 0 .* at global \(0, 3\)"}), worst) == ""
    assert _not_shown(bug({"grad:logits": r"^rank 1 "}), worst) == "grad:logits ~ /^rank 1 /"
    assert _not_shown(bug({"forward": r"."}), worst) == "forward ~ /./"  # a check that did not fail shows nothing


def test_no_capability_the_harness_has_is_listed_missing():
    """Each member of Capability says how to tell it has landed, and none has: when one lands, drop it and turn its
    entries into pairs.  None is missing today; the `ep` axis (issue 39, harness/core/topology.EXPERT_DIMS) has
    landed, and the two entries that waited for it are pairs."""
    from shardcheck.harness.core.topology import EXPERT_DIMS
    from shardcheck.harness.core.zoo_bug import Capability

    landed: dict[Capability, bool] = {}  # a member: whether the harness has it now
    assert set(landed) == set(Capability)
    assert not any(landed.values()), [c.name for c, has in landed.items() if has]
    assert {e.bug.needs for e in entries(ZOO)} <= {None, *Capability}
    assert "ep" in EXPERT_DIMS and "EP_AXIS" not in Capability.__members__
    assert {e.name: e.bug.needs for e in entries(ZOO) if e.name in EP_PAIRS} == dict.fromkeys(EP_PAIRS)


def test_an_entry_waiting_for_a_capability_has_no_pair_and_counts_missed_with_the_reason():
    """The extension point for a bug not expressible yet (docs/zoo.md): a stand-in member, since none is missing."""
    import sys

    from shardcheck.harness.core.zoo_bug import Bug, Capability
    from shardcheck.reports.zoo import recall_of

    class Lacking(Capability):
        PP_AXIS = "a pipeline-parallel axis"

    bug = Bug(
        thread="o/r#2",
        url="https://github.com/o/r/issues/2",
        title="t",
        symptom="s",
        time_to_find="d",
        fix="f",
        topology="tp=2",
        names=("forward",),
        needs=Lacking.PP_AXIS,
    )
    sys.path.insert(0, str(ZOO))
    try:
        from _pending import pending
        from _twins import twins
    finally:
        sys.path.remove(str(ZOO))
    assert twins(bug, lambda v, where: pytest.fail("no case is made")) == [] == pending(bug)
    line = recall_of("x", bug, _rows("fail", {d: "pass" for d in ("float64", "float32", "bfloat16")}))
    assert (line.caught, line.step, line.named, line.missed) == (False, None, False, "needs a pipeline-parallel axis")


def test_nemo_12210s_broken_halves_are_exact_at_one_row_and_wrong_at_two():
    """The broken tail-half selection is the fixed one at micro-batch size 1, so the pair needs MBS 2 to differ."""
    import sys

    sys.path.insert(0, str(ZOO))
    try:
        import nemo_12210 as entry
    finally:
        sys.path.remove(str(ZOO))
    (broken_split, broken_join), (fixed_split, fixed_join) = entry.tail_half["broken"], entry.tail_half["fixed"]
    gen = torch.Generator().manual_seed(2)
    one, two = torch.randn(1, 8, 2, 3, generator=gen), torch.randn(2, 8, 2, 3, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(broken_split(one), fixed_split(one)))
    assert torch.equal(broken_join(*fixed_split(one)), one) and torch.equal(fixed_join(*fixed_split(two)), two)
    assert not torch.equal(broken_split(two)[1], fixed_split(two)[1])


def test_only_batch_invariance_sees_nemo_rl_1227(zoo_run):
    line = {b["entry"]: b for b in zoo_run[1]["bugs"]}["nemo_rl_1227"]
    assert line["finding"] == "property:batch_invariant:permuted, property:batch_invariant:split"  # values pass


def test_an_unknown_entry_is_one_line_and_exit_2():
    proc = cli("zoo", "no_such_bug")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"shardcheck: error: no zoo entry named no_such_bug; known: {', '.join(e.name for e in entries(ZOO))}"
    ]


# ---- batch invariance without ranks ------------------------------------------------------------------------------


def _row_local(impl, ctx, inputs):
    return inputs["x"].exp().sum(-1)


def _running_total(impl, ctx, inputs):
    total = inputs["x"].exp().flatten().cumsum(0).view_as(inputs["x"])[:, -1]
    return total - torch.cat([total.new_zeros(1), total[:-1]])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_row_local_op_is_batch_invariant(dtype):
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    check = batch_invariance(_row_local, ("x",))
    props = check(SimpleNamespace(impl=None), {"x": x}, {"x": x}, (_row_local(None, None, {"x": x}),))
    assert [(p.name, p.passed) for p in props] == [("batch_invariant:permuted", True), ("batch_invariant:split", True)]


def test_a_row_depending_on_the_rows_before_it_is_not():
    x = 2 * torch.randn(5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    check = batch_invariance(_running_total, ("x",))
    props = check(SimpleNamespace(impl=None), {"x": x}, {"x": x}, (_running_total(None, None, {"x": x}),))
    assert not any(p.passed for p in props)
    assert "rows change when the batch is permuted: local row" in props[0].message
    assert 0 < props[0].value < 1e-12  # within any float64 budget: only the same row computed twice disagrees
    assert check(SimpleNamespace(impl=None), {}, {"x": x[:1]}, (x[:1].sum(-1),))[0].passed  # one row: nothing to move


# ---- the table's verdicts, from rows ------------------------------------------------------------------------------


def _rows(broken: str, fixed: dict[str, str]):
    import pandas as pd

    rows = [{"family": "x", "case_id": "broken", "dtype": "float64", "status": broken, "item_seconds": 1.0}]
    rows += [
        {"family": "x", "case_id": "fixed", "dtype": d, "status": s, "item_seconds": 2.0} for d, s in fixed.items()
    ]
    return pd.DataFrame(rows)


def test_a_broken_case_that_passes_is_not_caught_and_a_failing_twin_is_a_false_alarm():
    from shardcheck.harness.core.zoo_bug import Bug
    from shardcheck.reports.zoo import recall_of, summary

    bug = Bug(
        thread="o/r#1",
        url="https://github.com/o/r/issues/1",
        title="t",
        symptom="s",
        time_to_find="d",
        fix="f",
        topology="tp=2",
        names=("forward",),
    )
    line = recall_of("x", bug, _rows("pass", {"float64": "pass", "float32": "fail"}))
    assert (line.caught, line.step, line.named, line.missed) == (False, None, False, "not caught")
    assert line.false_alarm == "float32: fail; bfloat16: not run" and line.seconds == 5.0
    assert summary([line]) == {
        "bugs": 1,
        "caught_at_step_1": 0,
        "named_right": 0,
        "false_alarms": 1,
        "caught_rate": 0.0,
        "named_rate": 0.0,
        "targets_met": False,
    }


def test_the_json_carries_each_bugs_thread_and_story(zoo_run):
    for line in zoo_run[1]["bugs"]:
        assert line["bug"]["url"].startswith("https://github.com/") and line["bug"]["symptom"], line["entry"]
