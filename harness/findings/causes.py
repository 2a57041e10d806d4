"""Group a run's non-passing rows into causes: what a person would find reading them all by hand.

Everything is read from the structured fields of the rows (shardcheck.harness.core.records.ResultRow: the symptom,
the culprit ranks, the exception's type, message and raising location, the phase), never parsed out
of the messages; only an exception's own message has its numbers blanked, so alike errors group.

1. Symptoms.  Per op, the non-passing rows group by status and what went wrong: an exception (type,
   message, raising line), a rank that died, a hang, or per check a wrong value, dtype, shape, a
   missing gradient; a property that does not hold; a warning's finding.  A rank that raised and the
   peers that then blocked or lost their connection are one symptom, named by the exception
   (shardcheck.harness.driver.collect records the raising rank as the item's cause on every error row of the item).
2. Conditions.  Each symptom gets the condition that separates its rows from the op's passing rows:
   the smallest conjunction of predicates over the check, dtype, mesh dims and case parameters that
   holds on every row of the symptom and on no passing row ("exactly in grad:logits, at tp ≥ 2"), or else
   on no passing row of the items the symptom does not fail in (the other checks of its own items pass beside
   it).  A condition that does not separate is not printed: the line says none separates (a trigger the
   features do not see, such as a loss_mask's padding, gives that, never a condition that points away).
   A condition is computed from the items that ran, and must hold on the items a hang's budget skipped at the
   symptom's topology (they may show it too: the condition never cites a dtype or case they had); the line says how
   many were skipped.
3. Causes per op.  A crash (an exception at one raising line, a death, a hang) is one line; the checks failing in
   its items at or after the phase it crashed in are its consequences, counted and named on its line.  A check
   failing where nothing crashed is never folded into a crash's line, except when one condition on the items
   separates the crash's and the wrong answers' items together from the clean ones (one bug, two faces).  Among
   the wrong answers: symptoms failing in the same items are one cause; so are all of them when one
   condition on the items separates the op's failing items exactly from its clean ones (one bug
   showing in several checks).  A symptom wrong in every item does not swallow the others: each keeps
   its own line unless it has no sharp condition of its own, or fails wherever its checks ran (the
   sum of wrong losses is wrong wherever it is checked), so "grad:student_logits wrong exactly at
   tp ≥ 2" and a hang stand beside "forward wrong everywhere".  Otherwise, when every item fails
   somewhere, it is one bug; else symptoms that share items are one cause.  Two different crashes
   stay two causes.  Warnings keep lines of their own, except properties warning in the same items (failures of
   rules of ours under --impl): one cause, as they would be as failures.  A signature that lacks a seed parameter
   and the TypeError of every call passing it (harness/rank/signatures.py calls by the seed's names) are one line.
4. Causes across ops: one root is one line naming its ops: the same exception type and message, numbers blanked,
   raised in the same file (a helper several ops share, one unhandled input reaching several of its lines; one line
   raising two messages is two roots, and so are raises at lines two ops do not share, one on input only our rules
   feed: shared_roots.apart_by_rule), the same warning over the module (float64 computed in float32 in every op),
   ranks dying of crash signals (SIGSEGV, SIGABRT, SIGBUS, ...) in a shared phase (an op and its wrapper: each op's
   condition may differ), wrong answers under one rule of ours on input outside the seed (kept apart from the op's
   seed-rule symptoms), exceptions saying the machine has no GPU (findings/shared_roots.py).
5. Whose rule, per line: under `--impl`, a line whose exception shows only on rows judged by rules of ours (every
   row of the line, its consequences included, has rule_source "ours") is a `warn`: "raises on input only our rule
   feeds: ..." (loud on input the seed leaves open is acceptable, loud or right), where the evidence says that the
   input is the trigger: at each op, topology and dtype of the line, a case judged by the seed's rules ran without
   it (else, a run of only our-rule cases, the raise may be the op's own and the line stays an `error`).  It is
   decided per line, after the grouping by root, never per row: the same exception on a seed-rule case too keeps the
   one line an `error`.
   Our own implementations are held to our rules (no such warn).  shardcheck.harness.findings.verdicts then marks
   the line's rows `warn` (`demoted_from`: "error"), so that the exit code, the JUnit and the report say what the
   line says; this module reads such rows as the errors they were, and decides again, the same way.

Skipped rows are consequences (a hang's other items) and are not causes; neither are `xfail` rows (a case's
KnownFailure that still fails: `known_failures` lists them, one line per mark).  An `xpass` row (a known failure
that now passes) is a finding of its own: its mark must go.

This module groups; the conditions (2) are shardcheck.harness.findings.conditions, the words of a row and a line
shardcheck.harness.findings.wording, the known failures shardcheck.harness.findings.known.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from shardcheck.harness.core.citations import RuleSource
from shardcheck.harness.core.compare import NOT_PASSING, STATUS_ORDER
from shardcheck.harness.core.modules import is_ours
from shardcheck.harness.core.records import PHASES, SIGNATURE_CHECK, Phase, Status, Symptom, with_mesh_splits
from shardcheck.harness.findings import frames, model_order, shared_roots
from shardcheck.harness.findings.common_factor import apart_by_scale, factor_text, is_scaled, scale_kinds
from shardcheck.harness.findings.conditions import ITEM, separating_condition
from shardcheck.harness.findings.hang_skips import not_run, skipped_by_hangs, skipped_like
from shardcheck.harness.findings.shared_roots import (
    apart_by_rule,
    by_rule,
    ours_rule_of,
    same_rules,
    shared_key,
    warn_twins,
    worded,
)
from shardcheck.harness.findings.wording import (
    CRASHES,
    ERRORS,
    blank_numbers,
    call_by_seed_names,
    check_part,
    checks_text,
    display,
    err_ratio,
    group_kind,
    item_count,
    rule_text,
    symptom_of,
    where_text,
    worst_text,
)

COLUMNS = ["op", "ops", "status", "kind", "checks", "count", "condition", "worst", "rerun", "rule"]
CRASH_SIGNALS = {"SIGABRT", "SIGBUS", "SIGSEGV", "SIGFPE", "SIGILL"}


def causes(df: pd.DataFrame) -> pd.DataFrame:
    """One row per cause of a run's non-passing rows (COLUMNS; `ops` the ops it covers, `op` them for
    people), errors first, then failures, then warnings."""
    return _frame(_table(df))


def causes_and_demoted(df: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[list, str]]]:
    """`causes(df)` and `demoted_lines(df)` from one grouping of the rows (the grouping is the costly part).  The
    causes are the same before and after verdicts.py demotes the lines' rows: this module reads a demoted row as the
    error it was (`_as_judged`)."""
    table = _table(df)
    return _frame(table), _demoted_of(table)


def _frame(table: list[dict]) -> pd.DataFrame:
    out = pd.DataFrame(
        [{**{k: c[k] for k in COLUMNS if k != "rule"}, "rule": rule_text(c["rules"])} for c in table], columns=COLUMNS
    )
    order = out["status"].map(STATUS_ORDER)
    return (
        out.assign(_o=-order, _n=-out["count"])
        .sort_values(["_o", "_n", "op"], kind="stable")
        .drop(columns=["_o", "_n"])
        .reset_index(drop=True)
    )


RAISES_ON_OURS = "raises on input only our rule feeds: "  # a demoted line's kind begins so (module docstring, 5)


def demoted_lines(df: pd.DataFrame) -> list[tuple[list, str]]:
    """The lines demoted to `warn` (module docstring, 5): per line, the index labels of its rows in `df` (the
    exception's and its consequences') and the rule text it names."""
    return _demoted_of(_table(df))


def _demoted_of(table: list[dict]) -> list[tuple[list, str]]:
    # a line merged by its rule of ours (shared_roots.one_line_per_input_rule) demotes its raises' rows alone
    return [(c.get("demoted_members", c["members"]), rule_text(c["rules"])) for c in table if c.get("demoted")]


def _as_judged(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with the status the ranks gave them: a row of a demoted line (verdicts.py) is the error it was."""
    if "demoted_from" not in df:
        return df
    was = df["demoted_from"]
    return df.assign(status=was.where(was.notna() & (was != ""), df["status"]))


def _third_party(spec) -> bool:
    return isinstance(spec, str) and not is_ours(spec)  # (None or NaN: the family's own implementation)


# where a seed-rule case must have run without a demoted line's exception
WHERE = ["op", "dp", "dp_replicate", "ep", "cp", "tp", "dtype"]


def _demoted(c: dict, bad: pd.DataFrame, seed_items: set, unrun: set = frozenset()) -> dict:
    """`c`, a `warn` line if its exception shows only on rows judged by rules of ours, of modules under --impl, and
    seed-rule cases ran without it at each op, topology and dtype it shows at (`seed_items`: their (op, item)), but
    where a hang's budget left the op's other items unrun (`unrun`: (op, dp, cp, tp, dtype)), if it has evidence
    elsewhere."""
    if c["status"] != Status.ERROR or c["symptoms"] != {Symptom.EXCEPTION}:
        return c
    rows = bad.loc[c["members"]]
    if "rule_source" not in rows or "impl" not in rows or not (rows["rule_source"] == RuleSource.OURS).all():
        return c
    if not all(_third_party(spec) for spec in rows["impl"]):
        return c  # our own implementations: we hold ourselves to our rules
    raised = set(map(tuple, rows[["op", *ITEM]].astype(str).values))
    clean = {(op, *item[1:]) for op, *item in seed_items if (op, *item) not in raised}  # (op, dp, cp, tp, dtype)
    where = set(map(tuple, rows[WHERE].astype(str).values))
    if not where - unrun <= clean or not where & clean:
        return c  # no seed-rule case ran there without it: nothing says the input is the trigger
    return {**c, "status": Status.WARN, "kind": RAISES_ON_OURS + c["kind"], "demoted": True}


def _seed_items(df: pd.DataFrame) -> set:
    """(op, *ITEM) of the items whose values or gradients were judged by a rule of the seed's: a precision warning (it
    cites our precision rule) counts where its case's checks cite the seed's at that topology in another dtype."""
    if "rule_source" not in df:
        return set()
    ran = df[df["check"].astype(str).str.match(r"forward|grad:") & ~df["status"].isin([Status.SKIP, Status.XFAIL])]
    seed = ran["rule_source"] == RuleSource.SEED
    case = ["op", *ITEM[:-1]]  # an item less its dtype: a rule of the seed's there holds in every dtype
    in_seed_case = ran[case].astype(str).apply(tuple, axis=1).isin(set(map(tuple, ran[seed][case].astype(str).values)))
    precision = ran["symptom"].astype(str).str.startswith("precision:") if "symptom" in ran else seed & False
    return set(map(tuple, ran[seed | (precision & in_seed_case)][["op", *ITEM]].astype(str).values))


def _table(df: pd.DataFrame) -> list[dict]:
    """The causes (module docstring), as dicts: what `causes` prints and `demoted_lines` reads."""
    if not len(df) or "status" not in df:
        return []
    df = _as_judged(df)
    df = df[df["check"] != "bench"] if "check" in df else df
    df = with_mesh_splits(df)  # rows of runs before expert parallelism or HSDP, or written by hand: 1
    if "params" not in df:  # rows written by hand (tests, other tools) may leave the case parameters out
        df = df.assign(params=[{} for _ in range(len(df))])
    bad = df[df["status"].isin(NOT_PASSING)]
    if not len(bad):
        return []
    passing, records = df[df["status"] == Status.PASS], frames.records(bad)
    bad = bad.assign(
        _kind=[scaled or group_kind(r) for r, scaled in zip(records, scale_kinds(records, frames.records(passing)))],
        _part=[check_part(r) for r in records],
        _symptom=[symptom_of(r) for r in records],
    )
    bad = bad.assign(_status=bad["status"], _crash=bad["_symptom"].isin(CRASHES) & (bad["status"] == Status.ERROR))
    bad = _consequences(bad)
    bad = bad.assign(_rule=ours_rule_of(bad))  # a wrong answer under a rule of ours: apart from the seed's (4)
    passing_of = {op: rows for op, rows in passing.groupby("op", sort=False)}
    empty = df.iloc[:0]
    skipped_of, as_dicts = skipped_by_hangs(df), frames.RowDicts(bad)
    symptoms = []
    for (op, status, kind, _, _), rows in bad.groupby(["op", "_status", "_kind", "_part", "_rule"], sort=False):
        rows = rows.sort_values("_crash", ascending=False, kind="stable")  # the crash itself names the line
        stale = status == Status.XPASS  # a stale mark is judged where it ran; a hang's skips say nothing of it
        unknown = None if stale else skipped_like(rows, skipped_of.get(op))
        symptom = _symptom(op, status, kind, rows[rows["_crash"]] if rows["_crash"].any() else rows, rows, as_dicts)
        symptom["condition"] = _condition(symptom, rows, passing_of.get(op, empty), unknown)
        if not stale:
            symptom["condition"] += not_run(rows, skipped_of.get(op))
        symptoms.append(symptom)
    table = []
    for op in dict.fromkeys(s["ops"][0] for s in symptoms):
        of_op = [s for s in symptoms if s["ops"] == (op,)]
        table += _signature_and_its_calls(_per_op(of_op, df[df["op"] == op], passing_of.get(op, empty), bad), bad)
    seed_items = _seed_items(df)
    unrun = {tuple(map(str, key)) for rows in skipped_of.values() for key in rows[WHERE].values}
    judged = [_demoted(c, bad, seed_items, unrun) for c in _across_ops(table, bad, passing)]  # one root, whose rule
    return shared_roots.one_line_per_input_rule(
        judged, lambda group: _merge(group, _group_condition(group, bad, passing), bad)
    )


def _signature_and_its_calls(lines: list[dict], bad: pd.DataFrame) -> list[dict]:
    """An op's signature line and the TypeError every call by the seed's parameter names then raises (a seed
    parameter the module lacks): one root, one line, under the signature's condition (of the module)."""
    signature = [c for c in lines if c["symptoms"] == {Symptom.SIGNATURE}]
    said = signature[0]["kind"] if len(signature) == 1 else ""
    tested = set(bad.loc[[i for c in lines for i in c["rows"]], "impl"]) if "impl" in bad and said else set()
    calls = [c for c in lines if c["error_key"] is not None and call_by_seed_names(c["error_key"], said, tested)]
    if len(signature) != 1 or not calls:
        return lines
    merged = _merge(signature + calls, signature[0]["condition"])
    return [merged] + [c for c in lines if c not in signature and c not in calls]


def _phase_of_check(check: str) -> int:
    """Where in the item a check is judged: the forward, the backward, the properties after them."""
    phase = (
        Phase.FORWARD
        if check.startswith("forward")
        else Phase.BACKWARD
        if check.startswith("grad:")
        else Phase.PROPERTIES
    )
    return PHASES.index(phase)


def _consequences(bad: pd.DataFrame) -> pd.DataFrame:
    """A check failing in an item where the op raised, died or hung in that phase or before it fails *because* of
    it: its row joins the crash's line (status, kind, part), naming where else the crash shows.  A check failing in
    an item where nothing crashed before it keeps its own line, with its own condition (module docstring, 1)."""
    crashes = bad[bad["_crash"]]
    if not len(crashes) or crashes.index.equals(bad.index):
        return bad
    first: dict[tuple, tuple] = {}  # item -> (phase index, status, kind) of its earliest crash
    for r in crashes.to_dict("records"):
        key = (r["op"], *(str(r[k]) for k in ITEM))
        phase = PHASES.index(r["phase"]) if r.get("phase") in PHASES else 0
        if key not in first or phase < first[key][0]:
            first[key] = (phase, r["status"], r["_kind"])
    status, kind, part = list(bad["_status"]), list(bad["_kind"]), list(bad["_part"])
    for i, r in enumerate(bad.to_dict("records")):
        crash = first.get((r["op"], *(str(r[k]) for k in ITEM)))
        if r["_crash"] or crash is None or r["status"] == Status.WARN or crash[0] > _phase_of_check(str(r["check"])):
            continue
        status[i], kind[i], part[i] = crash[1], crash[2], ""
    return bad.assign(_status=status, _kind=kind, _part=part)


def _symptom(op: str, status: str, kind: str, rows: pd.DataFrame, all_rows: pd.DataFrame, as_dicts) -> dict:
    """One symptom from its rows, its condition to be set (`_condition`); `all_rows` adds the checks failing as its
    consequences (counted, listed).  `as_dicts`: the rows as dicts (frames.RowDicts of the frame they are from)."""
    records, all_records = as_dicts(rows), as_dicts(all_rows)
    symptom = records[0]["_symptom"]
    found = set(rows["_symptom"])
    if found <= {Symptom.VALUES, Symptom.NONFINITE} and not is_scaled(kind):
        kind = "; ".join(x.words for x in (Symptom.VALUES, Symptom.NONFINITE) if x in found)
    signals = (
        {how.strip() for r in records for how in str(r.get("error_type")).split(",")}
        if symptom == Symptom.DIED
        else set()
    )
    if symptom == Symptom.DIED:  # a rank dying: one symptom whatever the signal, which the words then list
        kind = f"{Symptom.DIED.words} ({', '.join(sorted(signals))})"
    worst = max(records, key=err_ratio) if status != Status.ERROR else records[0]
    if status != Status.ERROR:  # a model's step: its first divergence (an exception is named by where it was raised)
        worst = model_order.first_row(records, err_ratio) or worst
    rerun = (
        worst.get("rerun")
        if isinstance(worst.get("rerun"), str)
        else next((r["rerun"] for r in records if isinstance(r.get("rerun"), str)), None)
    )
    return {
        "op": op,
        "ops": (op,),
        "status": status,
        "kind": kind,
        "symptoms": found,
        "signals": signals,
        "checks": checks_text(list(all_rows["check"].unique()), status, factor_text(all_records)),
        "count": len(all_rows),
        "condition": "",
        "worst": worst_text(worst, status),
        "rerun": rerun,
        "rows": list(rows.index),
        "items": set(map(tuple, rows[ITEM].astype(str).values)),
        "all_checks": list(all_rows["check"].unique()),
        "rules": frames.rules_of(all_records),
        "members": list(all_rows.index),
        "ours_rule": str(all_rows["_rule"].iloc[0]) if "_rule" in all_rows else "",
        # one root per exception type and message (numbers blanked) raised in one file: a line that raises on two
        # inputs for two reasons is two roots, one unhandled input reaching several lines of the module is one
        "error_key": (
            worst.get("error_type"),
            _file_of(worst.get("error_where")),
            blank_numbers(worst.get("error_message")),
        )
        if symptom in ERRORS
        else ("died", frozenset(str(r.get("phase")) for r in records))  # a death: the phases it died in
        if symptom == Symptom.DIED
        else None,
    }


def _file_of(where) -> str:
    """The file of a raising location ("path/to/file.py:41" -> "path/to/file.py")."""
    return str(where).rsplit(":", 1)[0]


def _condition(symptom: dict, all_rows: pd.DataFrame, passing: pd.DataFrame, unknown: pd.DataFrame | None) -> str:
    """A symptom's condition, from the rows that name it (the crash's own, else all); it holds on the `unknown`
    rows too (items a hang's budget skipped: they may show it)."""
    rows = all_rows.loc[symptom["rows"]]
    if (rows["check"] == SIGNATURE_CHECK).all() and (rows["case_id"] == "signature").all():  # not a used family's
        return "of the module, found before any case ran"
    if symptom["status"] == Status.XPASS:  # where the mark no longer holds, rather than what separates it from passing
        return f"in {item_count(rows)} item(s) {where_text(rows)}"
    return separating_condition(rows if unknown is None else pd.concat([rows, unknown]), passing)


def _merge(group: list[dict], condition: str, bad: pd.DataFrame | None = None) -> dict:
    first = max(group, key=lambda s: (STATUS_ORDER[s["status"]], s["count"]))
    ops = list(dict.fromkeys(op for s in group for op in s["ops"]))
    signals = set().union(*(s["signals"] for s in group))
    kind = (
        f"{Symptom.DIED.words} ({', '.join(sorted(signals))})"
        if all(s["symptoms"] == {Symptom.DIED} for s in group)
        else "; ".join(dict.fromkeys(s["kind"] for s in group))
    )
    rows = (
        bad.loc[[i for s in group for i in s["rows"]]] if bad is not None and first["status"] != Status.ERROR else None
    )
    model_first = model_order.first_row(rows.to_dict("records"), err_ratio) if rows is not None else None
    members = bad.loc[[i for s in group for i in s["members"]]] if rows is not None else None
    factor = factor_text(members.to_dict("records")) if members is not None else ""
    worst = (
        {"worst": worst_text(model_first, model_first["status"]), "rerun": model_first.get("rerun")}
        if model_first
        else {}
    )
    return {
        **first,
        **worst,
        "op": display(ops),
        "ops": tuple(ops),
        "kind": kind,
        "symptoms": set().union(*(s["symptoms"] for s in group)),
        "signals": signals,
        "count": sum(s["count"] for s in group),
        "checks": checks_text([c for s in group for c in s["all_checks"]], first["status"], factor),
        "all_checks": [c for s in group for c in s["all_checks"]],
        "condition": condition,
        "rules": {k: None for s in group for k in s["rules"]},
        "members": [i for s in group for i in s["members"]],
        "rows": [i for s in group for i in s["rows"]],
        "items": set().union(*(s["items"] for s in group)),
        "error_key": first["error_key"] if all(s["error_key"] == first["error_key"] for s in group) else None,
        "ours_rule": first["ours_rule"] if all(s["ours_rule"] == first["ours_rule"] for s in group) else "",
    }


def _per_op(symptoms: list[dict], rows: pd.DataFrame, passing: pd.DataFrame, bad: pd.DataFrame) -> list[dict]:
    """The causes of one op from its symptoms (module docstring, 3).  A crash (an exception at one line, a death, a
    hang) is a line of its own with the checks it caused; it never takes in a check that failed where it did not
    cause the failure, and two different crashes stay two lines."""
    failing, ours = by_rule([s for s in symptoms if s["status"] in (Status.FAIL, Status.ERROR)])  # (docstring, 4)
    warnings = _same_items([s for s in symptoms if s["status"] not in (Status.FAIL, Status.ERROR)], passing, bad)
    twins, warnings = warn_twins(failing, warnings)
    failing = [_joined([s, *twins[id(s)]], passing, bad) if id(s) in twins else s for s in failing]
    signature = [s for s in failing if s["symptoms"] == {Symptom.SIGNATURE}]  # of the module: apart from any case's
    failing, warnings = [s for s in failing if s not in signature], signature + warnings
    crashes = [s for s in failing if s["symptoms"] & set(CRASHES)]
    wrong = [s for s in failing if not s["symptoms"] & set(CRASHES)]
    warnings += [line for group in ours.values() for line in _wrong_answers(group, rows, passing, bad, crashes)]
    if len(crashes) == 1 and wrong and same_rules(crashes + wrong):  # one trigger for a crash and wrong answers
        ran = rows[(rows["check"] != SIGNATURE_CHECK) & ~rows["status"].isin([Status.SKIP, Status.XFAIL])]
        item_rows = ran.drop_duplicates(ITEM)
        item_key = item_rows[ITEM].astype(str).apply(tuple, axis=1)
        dirty = set(map(tuple, ran[ran["status"].isin(NOT_PASSING)][ITEM].astype(str).values))
        clean = item_rows[~item_key.isin(dirty)]
        union = set().union(*(s["items"] for s in failing))
        if len(clean):
            condition = separating_condition(item_rows[item_key.isin(union)], clean, by_check=False)
            if condition.startswith("exactly"):
                return [_merge(failing, condition, bad)] + warnings
    answers = [x for group in apart_by_scale(wrong) for x in _wrong_answers(group, rows, passing, bad, crashes)]
    return crashes + answers + warnings


def _same_items(warnings: list[dict], passing: pd.DataFrame, bad: pd.DataFrame) -> list[dict]:
    """Warnings with their own lines (a precision or communication finding, a known failure that passes), except
    properties that warn in the same items (failures of rules of ours under --impl, core/rules.py): one cause, as
    they would be as failures (several buffers of one batch left whole after exit)."""
    groups: dict = {}
    for s in warnings:
        key = (frozenset(s["items"]),) if s["status"] == Status.WARN and s["symptoms"] == {Symptom.PROPERTY} else id(s)
        groups.setdefault(key, []).append(s)
    return [g[0] if len(g) == 1 else _joined(g, passing, bad) for g in groups.values()]


def _joined(group: list[dict], passing: pd.DataFrame, bad: pd.DataFrame) -> dict:
    return _merge(group, separating_condition(bad.loc[[i for s in group for i in s["rows"]]], passing), bad)


def _wrong_answers(
    failing: list[dict], rows: pd.DataFrame, passing: pd.DataFrame, bad: pd.DataFrame, crashes: list[dict]
) -> list[dict]:
    """The lines of an op's checks failing where nothing crashed: one bug showing in several checks is one line,
    an op wrong everywhere does not swallow a symptom with a sharp condition of its own."""
    if len(failing) < 2:
        return failing
    failing = [_merged(g, passing, bad) for g in _same_items_groups(failing)]  # the same items: one cause
    if len(failing) == 1:
        return failing
    evidence = _Evidence.of(failing, rows, crashes)
    if len(evidence.clean):  # one trigger on the items for all of them?
        union = set().union(*(s["items"] for s in failing))
        on_items = evidence.item_rows[evidence.item_key.isin(union)]
        condition = separating_condition(on_items, evidence.clean, by_check=False)
        if condition.startswith("exactly"):
            return [_merge(failing, condition, bad)]
    # wrong wherever its checks were judged: that does not swallow the op's other symptoms
    everywhere = [s for s in failing if s["items"] >= evidence.items or evidence.failing_wherever_judged(s)]
    if everywhere:
        return _around_everywhere(failing, everywhere, evidence, passing, bad)
    if not len(evidence.clean):  # failing somewhere in every item, nowhere in all: one bug
        return [_merge(failing, separating_condition(bad.loc[[i for s in failing for i in s["rows"]]], passing), bad)]
    # otherwise symptoms that share items are one cause
    components: list[list[dict]] = []
    for s in failing:
        joined = [g for g in components if any(s["items"] & t["items"] for t in g)]
        components = [g for g in components if g not in joined] + [[s] + [t for g in joined for t in g]]
    return [_merged(g, passing, bad) for g in components]


def _merged(group: list[dict], passing: pd.DataFrame, bad: pd.DataFrame) -> dict:
    """A group of symptoms as one line, under the condition of all their rows (one symptom: itself)."""
    if len(group) == 1:
        return group[0]
    return _merge(group, separating_condition(bad.loc[[i for s in group for i in s["rows"]]], passing), bad)


def _same_items_groups(symptoms: list[dict]) -> list[list[dict]]:
    """The symptoms grouped by the exact set of items they fail in, in order of first appearance."""
    groups: list[list[dict]] = []
    for s in symptoms:
        same = next((g for g in groups if g[0]["items"] == s["items"]), None)
        if same is None:
            groups.append([s])
        else:
            same.append(s)
    return groups


@dataclass(frozen=True)
class _Evidence:
    """The items that ran, less those a crash explains, where one of the symptoms' checks was judged."""

    item_rows: pd.DataFrame  # one row per such item
    item_key: pd.Series  # each of item_rows' ITEM as a tuple of strings
    items: set  # those keys
    clean: pd.DataFrame  # the item_rows of items where none of the checks fails
    checked: dict[str, set]  # check -> the items it was judged in

    @classmethod
    def of(cls, failing: list[dict], rows: pd.DataFrame, crashes: list[dict]) -> _Evidence:
        crashed = set().union(*(c["items"] for c in crashes)) if crashes else set()
        checks = {c for s in failing for c in s["all_checks"]}
        ran = rows[(rows["check"] != SIGNATURE_CHECK) & ~rows["status"].isin([Status.SKIP, Status.XFAIL])]
        ran = ran[~ran[ITEM].astype(str).apply(tuple, axis=1).isin(crashed)] if crashed else ran
        judged = ran[ran["check"].isin(checks)]
        item_rows = judged.drop_duplicates(ITEM)
        item_key = item_rows[ITEM].astype(str).apply(tuple, axis=1)
        dirty = set(map(tuple, judged[judged["status"].isin(NOT_PASSING)][ITEM].astype(str).values))
        checked = {
            check: set(map(tuple, of_check[ITEM].astype(str).values))
            for check, of_check in judged.groupby("check", sort=False)
        }
        return cls(item_rows, item_key, set(item_key), item_rows[~item_key.isin(dirty)], checked)

    def ran_in(self, s: dict) -> set:
        """The items any of the symptom's checks was judged in."""
        return set().union(*(self.checked.get(c, set()) for c in s["all_checks"]))

    def failing_wherever_judged(self, s: dict) -> bool:
        ran = self.ran_in(s)
        return bool(ran) and ran <= s["items"]


def _around_everywhere(
    failing: list[dict], everywhere: list[dict], evidence: _Evidence, passing: pd.DataFrame, bad: pd.DataFrame
) -> list[dict]:
    """One line for the symptoms wrong everywhere, taking in the others but those with a sharp condition of their
    own that fail only in some of the items their checks ran in (each keeps its line)."""
    primary = [s for s in everywhere if s["items"] >= evidence.items] or everywhere  # the condition is theirs
    host = _merged(primary, passing, bad)
    own = []
    for s in failing:
        if s in primary:
            continue
        if s in everywhere:
            host = _merge([host, s], host["condition"], bad)
            continue
        # a symptom with no sharp condition, or failing in each item its checks ran in (the sum of wrong
        # losses, wrong wherever it is checked), is the same wrong output seen again
        if not s["condition"].startswith("exactly") or evidence.ran_in(s) <= s["items"]:
            host = _merge([host, s], host["condition"], bad)
        else:
            own.append(s)
    return [host] + own


def _death_phases(c: dict, table: list[dict]) -> frozenset:
    """The phases of the deaths of `table` linked to `c`'s by a shared phase (an op and its wrapper dying in the
    backward, one in the forward too, are one root; one dying while judging, after its code returned, shares both)."""
    deaths = [d["error_key"][1] for d in table if d["symptoms"] == {Symptom.DIED} and d["error_key"] is not None]
    phases, ran = set(c["error_key"][1]), lambda p: p | ({"forward", "backward"} if "judging" in p else set())
    grown = True
    while grown:
        linked = [p for p in deaths if ran(p) & ran(phases) and not p <= phases]
        grown = bool(linked)
        phases |= set().union(*linked) if linked else set()
    return frozenset(phases)


def _across_ops(table: list[dict], bad: pd.DataFrame, passing: pd.DataFrame) -> list[dict]:
    """One root, one line (module docstring, 4): the same exception at the same line, the same warning,
    a rank dying under the same condition, in several ops."""

    def key(c: dict):
        if shared_key(c) is not None:  # a rule of ours, the environment (findings/shared_roots.py)
            return shared_key(c)
        if len(c["ops"]) != 1 or len(c["symptoms"]) != 1:
            return None
        symptom = next(iter(c["symptoms"]))
        if symptom in ERRORS and c["error_key"] is not None and c["status"] == Status.ERROR:
            return ("raised", c["error_key"])
        if c["status"] == Status.WARN and (symptom == Symptom.COMM or str(symptom).startswith("precision:")):
            return ("warned", c["kind"])
        if symptom == Symptom.DIED and c["signals"] <= CRASH_SIGNALS:  # a crash, not a kill from outside or an exit
            return (Symptom.DIED, _death_phases(c, table))  # crash signals in a shared phase, whatever the conditions
        return None

    groups: dict = {}
    for c in table:
        groups.setdefault(key(c) or ("own", id(c)), []).append(c)
    out = []
    for k, group in groups.items():
        if shared_key(group[0]) is not None:
            group = [{**c, "kind": worded(c["kind"], k)} for c in group]
        for part in apart_by_rule(group, bad) if k[0] == "raised" else [group]:
            out.append(part[0] if len(part) == 1 else _merge(part, _group_condition(part, bad, passing), bad))
    return out


def _group_condition(group: list[dict], bad: pd.DataFrame, passing: pd.DataFrame) -> str:
    """The condition of lines of several ops made one: theirs where they share it, else that of all their rows."""
    conditions = {c["condition"] for c in group}
    if len(conditions) == 1:
        return conditions.pop()
    ops = [op for c in group for op in c["ops"]]
    return separating_condition(bad.loc[[i for c in group for i in c["rows"]]], passing[passing["op"].isin(ops)])
