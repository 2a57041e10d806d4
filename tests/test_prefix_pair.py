"""A real pre-fix / fixed pair (issue 31): a copy taken before a fix shows its bug as a findings line of its own, so
diffing the two versions' findings shows what the fix changed.  The pre-fix cp_utils computes the THD padding mask
from token ids and requires position_ids (which the seed makes optional); the fixed one keeps the second defect."""

from __future__ import annotations

import re

from helpers import BROKEN, shardcheck

ARGS = (
    "run",
    "--suite",
    "cp_utils",
    "--op",
    "cp_utils.make_cp_batch_for_te",
    "--case",
    "packs-sentinel",
    "--case",
    "positions-pad3",
    "--case",
    "single",
    "--topology",
    "dp=1,cp=2,tp=1",
    "--dtype",
    "float64",
)


def _lines(run) -> set[str]:
    """Each findings line as a user diffs it: status, op and what went wrong, the raising file's name left out (the two
    versions are two files)."""
    return {f"{c.status} {c.op}: {re.sub(r' [(][^()]*[.]py:[0-9]+[)]$', '', c.kind)}" for c in run.causes.itertuples()}


def test_the_pre_fix_copy_prints_its_bug_as_a_line_the_fixed_one_does_not(tmp_path):
    pre = shardcheck(
        *ARGS, "--impl", f"cp_utils={BROKEN / 'cp_utils' / 'thd_prefix_mask_by_token_id.py'}", out=tmp_path / "pre"
    )
    fixed = shardcheck(
        *ARGS,
        "--impl",
        f"cp_utils={BROKEN / 'cp_utils' / 'thd_fixed_requires_position_ids.py'}",
        out=tmp_path / "fixed",
    )
    assert pre.returncode == 1 and fixed.returncode == 1, pre.stdout + fixed.stdout
    before, after = _lines(pre), _lines(fixed)
    assert len(before) == 2 and len(after) == 1, (before, after)
    shared = "error cp_utils.make_cp_batch_for_te: KeyError: 'position_ids'"
    assert before & after == {shared}
    gone = before - after
    assert len(gone) == 1 and next(iter(gone)).startswith("fail cp_utils.make_cp_batch_for_te: property:padding_mask")
    # the fixed line names its raising line; the pre-fix's padding mask line its seed rule and the item that shows it
    line = pre.causes[pre.causes["kind"].str.startswith("property:padding_mask")].iloc[0]
    assert line["rule"].startswith("rule: seed: make_cp_batch_for_te returns 'padding_mask: Boolean mask")
    assert "[positions-pad3]" in line["worst"] and "expected False, got True" in line["worst"]
    raised = fixed.causes.iloc[0]
    assert "thd_fixed_requires_position_ids.py:15" in raised["worst"]
