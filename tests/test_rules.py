"""Every rule cited: each check of our suites says where its rule comes from (the seed, or our docs/ops section), a
findings line says which, and under --impl a failure of a rule that is ours alone warns (a wrong answer excepted)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from shardcheck.harness.core.bad_input import BAD_INPUT_CHECK
from shardcheck.harness.core.case import Case, Property
from shardcheck.harness.core.citations import (
    DOCUMENTED_RESULT,
    SIGNATURE_RULE,
    OutsideSeed,
    Rule,
    RuleSource,
    ours,
    seed,
)
from shardcheck.harness.core.model_case import StepCase
from shardcheck.harness.core.records import Status, Symptom
from shardcheck.harness.core.rules import under_rule
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.wording import finding_lines
from shardcheck.harness.rank.suite_loader import suite_cases
from shardcheck.suites._model_utils_checks import (
    CHUNK_ROWS,
    CP_LAYOUT_OPEN,
    OUTSIDE_VOCAB,
    TEMPERATURE,
    TOP_K_ZERO,
    UNEVEN_VOCAB,
)

ROOT = Path(__file__).resolve().parents[1]
SUITES = [
    "model_utils",
    "model_utils_cp",
    "model_utils_megatron",
    "cp_utils",
    "distributed_utils",
    "inbatch_neg_utils",
    "kd_loss",
    "moe",
]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a markdown page: its headings' slugs and explicit ids."""
    text = page.read_text()
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return slugs | set(re.findall(r'<a id="([^"]+)"', text))


DOCS_OPS = " ".join(" ".join(p.read_text().split()) for p in sorted((ROOT / "docs" / "ops").glob("*.md")))


def _seed_quotes(cite: str) -> list[str]:
    """The sentences a seed rule quotes ('...'), an elision (...) splitting one into its pieces."""
    quoted = re.findall(r"'(.+?)'(?=[\s;,)]|$)", cite)
    return [piece.strip() for q in quoted for piece in re.split(r"\s*\.\.\.\s*", q) if piece.strip()]


def _cite_problem(source: str, cite: str) -> str:
    """Why a rule's cite is not where it says (empty when it is): ours, a docs/ops page and section that exist; seed,
    each quoted sentence written in docs/ops too (the code never points outside the repository), or, quoting none,
    the harness's generic rules or a signature fragment docs/ops writes as it stands."""
    if source == RuleSource.OURS:
        page, _, anchor = cite.partition("#")
        if not (ROOT / page).is_file() or not page.startswith("docs/ops/"):
            return f"{cite}: no such docs/ops page"
        return "" if anchor in _anchors(ROOT / page) else f"{cite}: no such section"
    if source != RuleSource.SEED:
        return f"{cite}: source {source!r} is neither seed nor ours"
    quotes = _seed_quotes(cite)
    if not quotes:
        known = cite in (DOCUMENTED_RESULT.cite, SIGNATURE_RULE.cite) or " ".join(cite.split()) in DOCS_OPS
        return "" if known else f"{cite}: quotes no seed sentence, and docs/ops does not write it"
    missing = [q for q in quotes if " ".join(q.split()) not in DOCS_OPS]
    return f"{cite}: docs/ops does not quote {missing}" if missing else ""


def test_a_cite_is_checked_against_docs_ops():
    assert _cite_problem("seed", "make_cp_batch_for_te: 'Raises: ValueError – If qkv_format is not “thd”'") == ""
    assert "does not quote" in _cite_problem("seed", "op: 'A sentence no seed ever wrote.'")
    assert "quotes no seed sentence" in _cite_problem("seed", "what we think the seed means")
    assert _cite_problem("ours", "docs/ops/model_utils.md#top-k--top-p-filtering") == ""
    assert "no such section" in _cite_problem("ours", "docs/ops/model_utils.md#no-such-heading")
    assert "no such docs/ops page" in _cite_problem("ours", "README.md#installing")


def _cited_rules(case: Case) -> list[Rule]:
    rules = [case.rule, *case.rules.values()]
    return rules + ([case.bad_input.rule] if case.bad_input is not None else [])


@pytest.mark.parametrize("suite", SUITES)
def test_every_bad_input_and_rule_of_a_suite_cites_a_seed_sentence_or_a_docs_ops_section(suite):
    for quick in (True, False):
        for case in suite_cases(suite, quick):
            assert case.bad_input is None or case.bad_input.rule is not None, f"{case.op}[{case.case_id}]: no rule"
            assert case.rule_of(BAD_INPUT_CHECK if case.bad_input else "forward") is not None
            for rule in _cited_rules(case):
                assert not _cite_problem(rule.source, rule.cite), (
                    f"{case.op}[{case.case_id}]: {_cite_problem(rule.source, rule.cite)}"
                )


def test_every_check_our_suites_build_at_run_time_cites_a_rule_written_in_docs_ops(run_shardcheck):
    """Property names are built when a case runs (a key of the batch, a label of the case, a check a topology adds):
    the suites' cases that have properties, run as the planner gives them (their quick cases, at world sizes 1 and
    2: the DP, CP and TP of 2 that add names), and every check they emit, properties, bad inputs, forward, gradients
    and the communication contract, cites a rule whose cite is where it says (`_cite_problem`)."""
    ops = sorted({c.op for suite in SUITES for c in suite_cases(suite, True) if c.properties is not None})
    run = run_shardcheck(
        "run", *(a for op in ops for a in ("--op", op)), "--quick", "--world-sizes", "1,2", "--dtype", "float64"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert set(rows["op"]) == set(ops)
    uncited = rows[rows["rule_source"].isna() | rows["rule_cite"].isna()]
    assert not len(uncited), uncited[["op", "case_id", "check"]].drop_duplicates("check").to_string()
    properties = rows[rows["check"].str.startswith("property:")]
    # names a suite builds at run time, per topology, are among them
    assert {
        "property:reassembled:position_ids",
        "property:inside:labels",
        "property:dp_sum",
        "property:infer_group:vocab-on-tp",
        "property:unchanged:ids",
    } <= set(properties["check"])
    rules = rows[["rule_source", "rule_cite"]].drop_duplicates()
    problems = [p for r in rules.itertuples() if (p := _cite_problem(r.rule_source, r.rule_cite))]
    assert not problems, problems


def test_a_rule_of_ours_must_cite_its_docs_ops_section():
    with pytest.raises(ValueError, match="docs/ops"):
        ours("we like it that way")
    with pytest.raises(ValueError, match="cites"):
        seed(" ")
    assert str(ours("docs/ops/model_utils.md#x")) == "rule: ours, docs/ops/model_utils.md#x"
    assert str(seed("'Returns log-probs'")) == "rule: seed: 'Returns log-probs'"


def test_under_impl_an_ours_only_failure_warns_and_a_wrong_answer_stays_a_failure():
    rule = ours("docs/ops/model_utils.md#conventions-of-this-family")
    status, fields = under_rule(rule, Status.FAIL, {"message": "returned silently", "symptom": Symptom.PROPERTY}, True)
    assert status == Status.WARN and fields["rule_source"] == "ours"
    assert (
        "the rule is ours, not the seed's (rule: ours, docs/ops/model_utils.md#conventions-of-this-family)"
        in fields["message"]
    )
    status, fields = under_rule(rule, Status.FAIL, {"message": "max err 3", "symptom": Symptom.NONFINITE}, True)
    assert status == Status.FAIL and "outside the seed's stated shapes" in fields["message"]
    # our own implementations are held to our rules; the seed's rules hold for everyone
    assert under_rule(rule, Status.FAIL, {"symptom": Symptom.PROPERTY}, False)[0] == Status.FAIL
    assert under_rule(seed("'x'"), Status.FAIL, {"symptom": Symptom.PROPERTY}, True)[0] == Status.FAIL
    assert under_rule(None, Status.FAIL, {"symptom": Symptom.PROPERTY}, True) == (
        Status.FAIL,
        {"symptom": Symptom.PROPERTY},
    )


def test_a_property_cites_its_own_rule_before_the_cases_patterns():
    case = Case(
        op="f.Op",
        case_id="c",
        make_inputs=lambda g: {},
        reference=lambda x: (),
        run=lambda i, c, x: (),
        rules={"property:*": seed("'anything'")},
    )
    own = ours("docs/ops/kd_loss.md#kdloss")
    assert case.rule_of("property:p", Property("p", False, rule=own)) == own
    assert case.rule_of("property:p").source == RuleSource.SEED
    assert case.rule_of("grad:x") == case.rule and case.rule.source == RuleSource.SEED
    assert case.rule_of("property:comm").source == RuleSource.OURS


def _row(check: str, status: str, source: str | None, cite: str | None, **kw) -> dict:
    return {
        "op": "f.Op",
        "case_id": "c",
        "dp": 1,
        "cp": 1,
        "tp": 2,
        "dtype": "float64",
        "check": check,
        "status": status,
        "message": "",
        "params": {},
        "rule_source": source,
        "rule_cite": cite,
        "symptom": None if status == Status.PASS else Symptom.PROPERTY,
        **kw,
    }


def test_a_findings_line_says_whether_its_rule_is_the_seeds_or_ours():
    rows = [
        _row("property:a", Status.FAIL, "ours", "docs/ops/f.md#a"),
        _row("forward", Status.PASS, "seed", "the op's documented result"),
        _row("property:b", Status.WARN, "seed", "'Returns log-probs of shape [B, S]'"),
        {**_row("property:a", Status.PASS, "ours", "docs/ops/f.md#a"), "tp": 1},
    ]
    lines = [ln for ln in finding_lines(causes(pd.DataFrame(rows))) if not ln.startswith(" ")]
    assert any(
        ln.startswith("FAIL f.Op: property:a does not hold") and ln.endswith("[rule: ours, docs/ops/f.md#a]")
        for ln in lines
    ), lines
    assert any(ln.endswith("[rule: seed: 'Returns log-probs of shape [B, S]']") for ln in lines), lines


# ---- runs: our implementations cite every rule and stay silent; findings lines of --impl modules say whose rule


def test_our_implementations_give_no_finding_under_strict_and_every_row_cites_its_rule(run_shardcheck):
    """Our own implementations, a cheap subset (quick cases at one TP-2 topology, float64; the suites' own tests run
    the rest strict): zero findings, zero warnings under --strict (the helper's default), and every row says where
    its rule comes from."""
    run = run_shardcheck(
        "run", "--suite", "kd_loss,model_utils", "--quick", "--topology", "dp=1,cp=1,tp=2", "--dtype", "float64"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"].isin(["pass", "skip"])).all() and not len(run.causes)
    judged = rows[rows["status"] == "pass"]
    uncited = judged[judged["rule_source"].isna()]
    assert not len(uncited), uncited[["op", "case_id", "check"]].drop_duplicates("check")
    assert set(judged["rule_source"]) == {"seed", "ours"}


def test_impl_findings_lines_say_whether_the_rule_is_the_seeds_or_ours(run_shardcheck):
    """A third-party example (the older kd_loss the adapter guide adapts) and one of tests/impls (float64 computed in
    float32, a collective beyond the contract): each findings line ends with its rule, seed or ours."""
    legacy = run_shardcheck(
        "run",
        "--impl",
        "kd_loss=examples/adapters/legacy_kd_loss.py",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "group-b4s6v37-T1-nbltensor-chunk0-masked",
        "--world-sizes",
        "1",
        "--dtype",
        "float64",
    )
    assert legacy.returncode == 1
    lines = [ln for ln in legacy.stdout.splitlines() if ln.startswith(("  FAIL ", "  ERROR ", "  WARN "))]
    assert lines and all(re.search(r"\[rule: (seed: |ours, docs/ops/)[^]]+\]$", ln) for ln in lines), lines
    # the missing tp_group and the TypeError of the suite's constructor passing it: one line, the signature's first
    assert any("signature" in ln and "unexpected keyword argument 'tp_group'" in ln for ln in lines), lines
    assert any("[rule: seed: the seed's signature" in ln for ln in lines), lines

    fp32 = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={ROOT / 'tests/impls/fp32_extra_collectives_model_utils.py'}",
        "--op",
        "model_utils.DistributedLogprob",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--quick",
        "--dtype",
        "float64",
        strict=False,
    )
    assert fp32.returncode == 0, fp32.stdout[-3000:]
    lines = [ln for ln in fp32.stdout.splitlines() if ln.startswith(("  FAIL ", "  ERROR ", "  WARN "))]
    assert len(lines) == 2, lines
    assert all(ln.endswith("[rule: ours, docs/ops/README.md#conventions-shared-by-every-family]") for ln in lines), (
        lines
    )


@pytest.mark.parametrize(
    "family,suites",
    [
        ("model_utils", ["model_utils", "model_utils_cp", "model_utils_megatron"]),
        ("cp_utils", ["cp_utils"]),
        ("distributed_utils", ["distributed_utils"]),
        ("inbatch_neg_utils", ["inbatch_neg_utils"]),
        ("kd_loss", ["kd_loss"]),
        ("moe", ["moe"]),
    ],
)
def test_docs_ops_tags_every_rule_of_its_family_seed_or_ours(family, suites):
    text = (ROOT / "docs" / "ops" / f"{family}.md").read_text()
    table = text.split("## Rules: seed or ours", 1)[1]
    for suite in suites:
        for case in suite_cases(suite, False):
            for pattern, rule in case.rules.items():
                # the row naming this case (a rule of its own), else the pattern's row for every case
                rows = [ln for ln in table.splitlines() if ln.startswith(f"| `{pattern}` |")]
                line = next(
                    (ln for ln in rows if f"[{case.case_id}]" in ln),
                    next((ln for ln in rows if ln.split("|")[2].strip() == ""), None),
                )
                where = f"{family}.md: {pattern} ({rule.source}) for {case.op}[{case.case_id}]"
                assert line is not None and f"| {rule.source} |" in line, where
                cited = rule.cite if rule.source == RuleSource.SEED else f"#{rule.cite.partition('#')[2]})"
                assert cited in line, f"{where}: the table does not cite {rule.cite}"
            if case.bad_input is not None:
                assert f"[{case.case_id}]" in table and case.bad_input.rule.source in ("seed", "ours")
            for outside in case.outside_seed:  # input the seed does not describe: a row per kind, naming its rule
                line = next((ln for ln in table.splitlines() if f"| {outside.what}" in ln), None)
                where = f"{family}.md: {outside.what} for {case.op}[{case.case_id}]"
                assert line is not None and "| ours |" in line, where
                assert f"#{outside.rule.cite.partition('#')[2]})" in line, f"{where}: the table does not cite it"


def test_targets_outside_the_vocab_are_judged_under_our_rule():
    """The seed says nothing of ids outside [0, V) (−100, V+3): the values and gradients of cases that feed them are
    judged under our convention at every topology (a wrong answer there stays a failure, noting the input is outside
    the seed's)."""
    tp1, tp2 = Topology(1, 1, 1), Topology(1, 1, 2)
    for suite in ("model_utils", "model_utils_cp", "model_utils_megatron"):
        cases = [c for c in suite_cases(suite, False) if c.bad_input is None and not isinstance(c, StepCase)]
        masked = [c for c in cases if c.params.get("masked")]
        assert masked and all(
            c.rule_of("forward", topology=t).cite == OUTSIDE_VOCAB.cite for c in masked for t in (tp1, tp2)
        )
    plain = [
        c
        for c in suite_cases("model_utils", False)
        if c.bad_input is None and not any(o.holds_at(tp2) for o in c.outside_seed)
    ]
    assert plain and all(c.rule_of("forward", topology=tp2).source == RuleSource.SEED for c in plain)


def _case_of(suite: str, op: str, **params) -> Case:
    """The first case of `suite` for `op` whose parameters include `params`."""
    return next(
        c
        for c in suite_cases(suite, False)
        if c.op == f"model_utils.{op}" and c.bad_input is None and all(c.params.get(k) == x for k, x in params.items())
    )


def test_cp_layouts_the_seed_leaves_open_are_ours_at_cp_2_and_the_seeds_at_cp_1():
    """Issue 42: DTensor logits sharded over CP with no seq_index (the seed gives one with CP-sharded logits), and plain
    full-vocab logits handed a CP group (the seed's third path is 'Non-parallel'): our reading at CP ≥ 2, so a module
    that refuses them is loud (a warn), not an error the seed's rule finds. At CP 1 they are the seed's input."""
    cp1, cp2 = Topology(1, 1, 1), Topology(1, 2, 1)
    shard1 = [
        c
        for c in suite_cases("model_utils_cp", False)
        if c.params.get("variant") == "shard1" and not c.params.get("masked")
    ]
    plain = _case_of("model_utils_cp", "get_next_token_logprobs_from_logits", variant="plain")
    assert shard1 and all(c.rule_of("forward", topology=cp2).cite == CP_LAYOUT_OPEN.cite for c in shard1)
    assert all(c.rule_of("forward", topology=cp1).source == RuleSource.SEED for c in shard1)
    assert any(o.rule == CP_LAYOUT_OPEN and o.holds_at(cp2) and not o.holds_at(cp1) for o in plain.outside_seed)
    # the seed's own input at CP beside them, so that a refusal reads as one on our input only
    group = [
        c
        for c in suite_cases("model_utils_cp", False)
        if c.op.endswith(".get_next_token_logprobs_from_logits")
        and c.params.get("variant") == "vocab_parallel_group"
        and not c.params.get("masked")
    ]
    assert group and all(c.rule_of("forward", topology=cp2).source == RuleSource.SEED for c in group)


def test_uneven_vocab_shards_are_the_seeds_at_one_tp_and_ours_at_another_per_op():
    """Issue 42: a rule source that depends on the topology and the op.  V = 33 is the seed's own shape at TP 1 for
    every op; at TP 2 it is outside the seed of an op whose seed states `vocab_size//TP`
    (from_parallel_logits_to_logprobs) and still the seed's for one handed a per-rank range
    (ChunkedDistributedGatherLogprob), whose rule turns ours only where a TP rank holds no vocab entries (V = 1 at TP
    2)."""
    tp1, tp2 = Topology(1, 1, 1), Topology(1, 1, 2)
    even = _case_of("model_utils_cp", "from_parallel_logits_to_logprobs", V=33, temperature=1.0, masked=None)
    assert even.rule_of("forward", topology=tp1).source == RuleSource.SEED
    assert even.rule_of("grad:logits", topology=tp2) == UNEVEN_VOCAB
    ranged = _case_of("model_utils", "ChunkedDistributedGatherLogprob", V=33, masked=None)
    assert ranged.rule_of("forward", topology=tp2).source == RuleSource.SEED
    assert ranged.rule_of("forward", topology=Topology(1, 1, 8)) == UNEVEN_VOCAB  # 33 at TP 8: the last rank holds 0
    one = _case_of("model_utils", "ChunkedDistributedGatherLogprob", V=1)
    assert one.rule_of("forward", topology=tp1).source == RuleSource.SEED
    assert one.rule_of("forward", topology=tp2) == UNEVEN_VOCAB
    assert one.rule_of("property:chunked_equals_unchunked", topology=tp2) == UNEVEN_VOCAB  # whatever the check
    assert one.rule_of("property:comm", topology=tp2).cite != UNEVEN_VOCAB.cite  # the harness's own keeps its rule


def test_a_temperature_top_k_zero_and_a_chunk_tp_does_not_split_are_ours():
    """The seed names 'temperature scaling' among the sampling parameters' uses but not who scales, says top_k 'None
    or -1 to disable', and states no constraint on a chunk's rows: cases feeding such input cite our rule, the chunk
    only at the TP sizes that do not divide B·chunk_size."""
    tp2 = Topology(1, 1, 2)
    hot = _case_of("model_utils", "from_parallel_logits_to_logprobs", temperature=0.7, masked=None)
    assert hot.rule_of("forward", topology=tp2) == TEMPERATURE
    assert _case_of("model_utils", "DistributedLogprobWithSampling", top_k=0).rule_of("forward") == TOP_K_ZERO
    chunked = _case_of("model_utils", "ChunkedDistributedLogprobWithSampling", B=4, chunk_size=3, masked=None)
    assert chunked.rule_of("forward", topology=Topology(1, 1, 8)) == CHUNK_ROWS  # 4·3 rows over TP 8
    assert chunked.rule_of("forward", topology=Topology(1, 1, 4)).source == RuleSource.SEED  # 12 over 4


def test_input_outside_the_seed_must_be_judged_under_a_rule_of_ours():
    with pytest.raises(ValueError, match="rule of ours"):
        OutsideSeed("anything", seed("'a sentence'"))
    at_tp2 = OutsideSeed("V = 3", ours("docs/ops/model_utils.md#uneven-vocab-shards"), lambda t: t.tp == 2)
    assert at_tp2.holds_at(Topology(1, 1, 2)) and not at_tp2.holds_at(Topology(1, 1, 1))
    assert not at_tp2.holds_at(None)  # without a topology, only what holds everywhere


def test_rows_cite_the_rule_of_their_topology(run_shardcheck):
    """End to end: the ranks judge each row under the rule of its own topology.  V = 37 is the seed's shape at TP 1
    and outside it at TP 2 for _compute_distributed_log_softmax ('vocab_size//TP'); masked targets are ours at both."""
    run = run_shardcheck(
        "run",
        "--op",
        "model_utils._compute_distributed_log_softmax",
        "--op",
        "model_utils.DistributedLogprob",
        "--case",
        "b4s6v37*",
        "--world-sizes",
        "1,2",
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows[run.rows["check"].isin(["forward", "grad:logits"])]
    cited = {(r.op.split(".")[1], r.tp, r.rule_cite) for r in rows.itertuples()}
    assert cited == {
        ("_compute_distributed_log_softmax", 1, DOCUMENTED_RESULT.cite),
        ("_compute_distributed_log_softmax", 2, UNEVEN_VOCAB.cite),
        ("DistributedLogprob", 1, OUTSIDE_VOCAB.cite),
        ("DistributedLogprob", 2, OUTSIDE_VOCAB.cite),
    }, cited
