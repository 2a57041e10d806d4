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
   A condition is computed from the items that ran: where a hang's budget skipped items at the symptom's topology,
   the line says how many (they may show it too).
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
   rules of ours under --impl): one cause, as they would be as failures.
4. Causes across ops: one root is one line naming its ops: the same exception raised at the same line
   (a helper several ops share), the same warning over the module (float64 computed in float32 in
   every op), a rank dying of a crash signal (SIGSEGV, SIGABRT, SIGBUS, ...) under the same condition.
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
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.case import RuleSource
from shardcheck.harness.core.compare import NOT_PASSING, STATUS_ORDER
from shardcheck.harness.core.records import PHASES, SIGNATURE_CHECK, SYMPTOMS, Phase, Status, Symptom
from shardcheck.harness.core.rules import is_ours
from shardcheck.harness.findings import model_order

COLUMNS = ["op", "ops", "status", "kind", "checks", "count", "condition", "worst", "rerun", "rule"]
MESH = ("dp", "cp", "tp")
ITEM = ["case_id", "dp", "cp", "tp", "dtype"]
ERRORS = (Symptom.EXCEPTION, Symptom.REFERENCE)  # symptoms named by an exception
CRASHES = (
    Symptom.EXCEPTION,
    Symptom.REFERENCE,
    Symptom.DIED,
    Symptom.HUNG,
    Symptom.OUTPUTS,
    Symptom.MISSING,
    Symptom.BLOCKED,
)  # the whole item failed
PER_CHECK = (
    Symptom.VALUES,
    Symptom.NONFINITE,
    Symptom.SHAPE,
    Symptom.DTYPE,
    Symptom.OUTPUT_TYPE,
    Symptom.NO_GRADIENT,
)  # one symptom per check
MAX_CONJUNCTION = 3  # predicates tried together when searching for an exact condition
CRASH_SIGNALS = {"SIGABRT", "SIGBUS", "SIGSEGV", "SIGFPE", "SIGILL"}

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def blank_numbers(text: str) -> str:
    """`text` with its numbers (ranks, shapes, sizes, seconds) written N, so alike messages compare equal."""
    return _NUMBER.sub("N", str(text or ""))


def _symptom_of(row) -> str | None:
    """The row's symptom; for rows of runs recorded before rows had one, what the status and fields say."""
    if isinstance(row.get("symptom"), str):
        return row["symptom"]
    check, status = str(row["check"]), row["status"]
    mismatch = row.get("mismatch") if isinstance(row.get("mismatch"), dict) else {}
    if check == SIGNATURE_CHECK:
        return "signature"
    if check == "property:comm":
        return "comm"
    if status == Status.FAIL and check.startswith("property:"):
        return "property"
    if status == Status.FAIL:
        return {"nonfinite": Symptom.NONFINITE, "shape": Symptom.SHAPE}.get(mismatch.get("kind"), Symptom.VALUES)
    return None  # an old error or warning: its message, numbers blanked, names it


def kind_of(row) -> str:
    """What went wrong in one non-passing row, in a few words (rows of one kind may share a cause)."""
    symptom, check, status = _symptom_of(row), str(row["check"]), row["status"]
    if symptom in ERRORS:
        where = Path(str(row.get("error_where") or "?")).name
        text = f"{row.get('error_type')}: {blank_numbers(row.get('error_message'))}".rstrip(": ")
        return ("reference failed: " if symptom == Symptom.REFERENCE else "") + f"{text[:160]} ({where})"
    if symptom == Symptom.SIGNATURE:
        return str(row["message"])
    if symptom == Symptom.COMM:
        return "more collectives than the contract allows" if status == Status.WARN else "communication contract failed"
    if symptom == Symptom.PROPERTY:
        return f"{check} does not hold"
    if symptom in SYMPTOMS:
        return SYMPTOMS[symptom]
    return f"{status}: {blank_numbers(row.get('message'))[:160]}"


def _group_kind(row) -> str:
    """kind_of, except that wrong and non-finite values of one check are one symptom (the numbers are wrong)."""
    return Symptom.VALUES.words if _symptom_of(row) in (Symptom.VALUES, Symptom.NONFINITE) else kind_of(row)


def _part(row) -> str:
    """A wrong value is a symptom per check (the forward and a gradient may be wrong under different
    conditions); an exception, a death or a hang fails the whole item."""
    return str(row["check"]) if _symptom_of(row) in PER_CHECK else ""


# --------------------------------------------------------------------------------------------------- conditions

Predicate = tuple[str, float, Callable[[dict], bool]]  # (words, order: lower is preferred, test on a row)


def _predicates(rows: list[dict], by_check: bool = True) -> list[Predicate]:
    """Candidate conditions from the values these rows take: check, dtype, mesh dims, case parameters."""
    out: list[Predicate] = []
    checks = sorted({str(r["check"]) for r in rows}) if by_check else []
    for check in checks:
        out.append((f"in {check}", 0, lambda r, c=check: r["check"] == c))
    if any(c.startswith("grad:") for c in checks):
        out.append(("in the gradients", 0, lambda r: str(r["check"]).startswith("grad:")))
    if any(c.startswith("forward") for c in checks):
        out.append(("in the outputs", 0, lambda r: str(r["check"]).startswith("forward")))
    if any(c.startswith("property:") for c in checks):
        out.append(("in values and gradients", 0, lambda r: not str(r["check"]).startswith("property:")))
    for dtype in sorted({r["dtype"] for r in rows}):
        out.append((f"in {dtype}", 1, lambda r, d=dtype: r["dtype"] == d))
    for dim in MESH:
        for v in sorted({r[dim] for r in rows}):
            if v > 1:
                out.append((f"at {dim} ≥ {v}", 2, lambda r, d=dim, v=v: r[d] >= v))
        out.append((f"at {dim} = 1", 2, lambda r, d=dim: r[d] == 1))
    params = [r["params"] if isinstance(r["params"], dict) else {} for r in rows]
    for key in sorted({k for p in params for k in p}):
        values = {p[key] for p in params if key in p and isinstance(p[key], (bool, int, float, str))}
        numbers = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
        get = lambda r, k=key: r["params"].get(k) if isinstance(r["params"], dict) else None  # noqa: E731
        order = 4 if len(key) == 1 else 3  # sizes (B, S, V) explain less than named conditions (scale, masked)
        if any(isinstance(v, bool) for v in values):
            out.append((f"with {key}", order, lambda r, g=get: g(r) is True))
            out.append((f"without {key}", order, lambda r, g=get: g(r) is not True))
            if any(v is False for v in values):  # set to False, as against not a parameter of the case at all
                out.append((f"with {key} = False", order, lambda r, g=get: g(r) is False))
        for v in sorted(v for v in values if isinstance(v, str)):
            out.append((f"with {key} = {v}", order, lambda r, g=get, v=v: g(r) == v))
            out.append((f"with {key} ≠ {v}", order + 0.5, lambda r, g=get, v=v: g(r) is not None and g(r) != v))
        for v in numbers:
            num = lambda r, g=get: g(r) if isinstance(g(r), (int, float)) and not isinstance(g(r), bool) else None  # noqa: E731
            out.append((f"when {key} ≥ {v:g}", order, lambda r, n=num, v=v: n(r) is not None and n(r) >= v))
            out.append((f"when {key} ≤ {v:g}", order + 0.5, lambda r, n=num, v=v: n(r) is not None and n(r) <= v))
            if v == 0:
                out.append((f"when {key} = 0 or unset", order, lambda r, n=num: not n(r)))
    return out


def _records(df: pd.DataFrame) -> list[dict]:
    return df[["check", "dtype", "params", *MESH]].to_dict("records")


def separating_condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool = True) -> str:
    """Words for the condition under which `bad` rows occur and `passing` rows do not (module docstring, 2).  Only a
    condition that separates is printed: one that holds on no passing row, or else on no passing row of an item
    the symptom does not fail in (the other checks of its own items pass beside it); otherwise none is."""
    words, exact = _condition(bad, passing, by_check)
    if exact:
        return words
    key = [c for c in ("op", *ITEM) if c in bad and c in passing]
    failing = set(map(tuple, bad[key].astype(str).values))
    others = passing[~passing[key].astype(str).apply(tuple, axis=1).isin(failing)] if len(passing) else passing
    if len(others) < len(passing):
        words, exact = _condition(bad, others, by_check)
        if exact:
            return words
    topologies = sorted({f"dp{r['dp']}-cp{r['cp']}-tp{r['tp']}" for r in _records(bad)})
    return (
        f"no condition on checks, dtypes, mesh dims or case parameters separates it from the {len(passing)} "
        f"passing rows, at {', '.join(topologies)}"
    )


def _condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool) -> tuple[str, bool]:
    """(words, whether they separate `bad` from every row of `passing`): the smallest exact conjunction."""
    bad_rows, passing_rows = _records(bad), _records(passing)
    candidates = []
    for words, order, test in _predicates(bad_rows + passing_rows, by_check):
        if all(test(r) for r in bad_rows):
            # the passing rows it holds on, as a bit set
            candidates.append((words, order, sum(1 << i for i, r in enumerate(passing_rows) if test(r))))
    topologies = sorted({f"dp{r['dp']}-cp{r['cp']}-tp{r['tp']}" for r in bad_rows})
    chosen, _ = _exact_conjunction(candidates, len(passing_rows))
    if chosen is None:
        return "", False
    where = (
        []
        if any(p[1] == 2 for p in chosen)
        else ([f"at every topology ({', '.join(topologies)})"] if len(topologies) > 1 else [f"at {topologies[0]}"])
    )
    words = ", ".join([p[0] for p in chosen] + where)
    if not chosen:  # nothing passed, or nothing needed: every row of the op's evidence fails
        return f"always (every case, dtype and check run), {words}", True
    return f"exactly {words}", True


def _exact_conjunction(candidates, n_passing: int):
    """The smallest conjunction (then the most preferred) that excludes every passing row, or (None, n)."""
    if n_passing == 0:
        return [], 0
    for size in range(1, MAX_CONJUNCTION + 1):
        exact = []
        for combo in itertools.combinations(candidates, size):
            held = (1 << n_passing) - 1
            for c in combo:
                held &= c[2]
            if not held:
                exact.append(combo)
        if exact:
            best = min(exact, key=lambda combo: (sum(c[1] for c in combo), [c[1] for c in combo]))
            return sorted(best, key=lambda c: c[1]), 0
        if len(candidates) > 40 and size == 2:  # many parameters: pairs are as far as is cheap
            break
    return None, n_passing


# ----------------------------------------------------------------------------------------------------- causes


def _ratio(row) -> float:
    r = row.get("err_ratio")
    return math.inf if r is None or (isinstance(r, float) and math.isnan(r)) else float(r)


def _ranks(ranks) -> str:
    ranks = list(ranks) if isinstance(ranks, (list, tuple)) else []
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _worst_text(row, status: str, limit: int = 300) -> str:
    """The worst row of a cause, for people: who raised, died or hung, or the worst mismatch; then its item."""
    symptom = _symptom_of(row)
    blocked = row.get("blocked_ranks") if isinstance(row.get("blocked_ranks"), list) else []
    then = f"; {_ranks(blocked)} then blocked or lost the connection" if blocked else ""
    culprits = row.get("culprit_ranks") if isinstance(row.get("culprit_ranks"), list) else []
    if symptom in ERRORS:
        text = (
            f"{_ranks(culprits)} raised {row.get('error_type')} in {row.get('phase')} at {row.get('error_where')}: "
            f"{row.get('error_message')}{then}"
        )
    elif symptom == Symptom.DIED:
        said = f": {row['error_message']}" if row.get("error_message") else ""  # its last error lines
        text = f"{_ranks(culprits)} died: {row.get('error_type')} (in {row.get('phase')}){said}{then}"
    elif symptom == Symptom.HUNG:
        seen = f": {row['error_message']}" if row.get("error_message") else ""  # its stacks and collectives
        text = f"{_ranks(culprits)} did not finish (in {row.get('phase')}){seen}"
    elif symptom == Symptom.XPASS:
        text = str(row.get("message") or "")
    else:
        ratio = _ratio(row)
        text = (f"err/budget {ratio:.3g}: " if status != Status.ERROR and math.isfinite(ratio) else "") + str(
            row.get("message") or ""
        )
        if model_order.step_order(str(row.get("check"))) is not None:  # which module or parameter the numbers are of
            text = f"[{row['check']}] {text}"
    limit = limit * 2 if symptom in (Symptom.HUNG, Symptom.DIED) else limit  # where each rank was takes room
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"{text} ({row['op']} [{row.get('case_id')}] dp{row['dp']}-cp{row['cp']}-tp{row['tp']} {row['dtype']})"


def _display(ops: list[str]) -> str:
    """One op as it is; several of one family as family.{A, B}."""
    if len(ops) == 1:
        return ops[0]
    families = {op.split(".", 1)[0] for op in ops}
    if len(families) == 1:
        return f"{families.pop()}.{{{', '.join(op.split('.', 1)[1] for op in ops)}}}"
    return ", ".join(ops)


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
    return [(c["members"], rule_text(c["rules"])) for c in table if c.get("demoted")]


def _as_judged(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with the status the ranks gave them: a row of a demoted line (verdicts.py) is the error it was."""
    if "demoted_from" not in df:
        return df
    was = df["demoted_from"]
    return df.assign(status=was.where(was.notna() & (was != ""), df["status"]))


def _third_party(spec) -> bool:
    return isinstance(spec, str) and not is_ours(spec)  # (None or NaN: the family's own implementation)


WHERE = ["op", "dp", "cp", "tp", "dtype"]  # where a seed-rule case must have run without a demoted line's exception


def _demoted(c: dict, bad: pd.DataFrame, seed_items: set) -> dict:
    """`c`, a `warn` line if its exception shows only on rows judged by rules of ours, of modules under --impl, and
    seed-rule cases ran without it at each op, topology and dtype it shows at (`seed_items`: their (op, item))."""
    if c["status"] != Status.ERROR or c["symptoms"] != {Symptom.EXCEPTION}:
        return c
    rows = bad.loc[c["members"]]
    if "rule_source" not in rows or "impl" not in rows or not (rows["rule_source"] == RuleSource.OURS).all():
        return c
    if not all(_third_party(spec) for spec in rows["impl"]):
        return c  # our own implementations: we hold ourselves to our rules
    raised = set(map(tuple, rows[["op", *ITEM]].astype(str).values))
    clean = {(op, *item[1:]) for op, *item in seed_items if (op, *item) not in raised}  # (op, dp, cp, tp, dtype)
    if not set(map(tuple, rows[WHERE].astype(str).values)) <= clean:
        return c  # no seed-rule case ran there without it: nothing says the input is the trigger
    return {**c, "status": Status.WARN, "kind": RAISES_ON_OURS + c["kind"], "demoted": True}


def _seed_items(df: pd.DataFrame) -> set:
    """(op, *ITEM) of the items whose values or gradients were judged by a rule of the seed's."""
    if "rule_source" not in df:
        return set()
    judged = df[
        (df["rule_source"] == RuleSource.SEED)
        & df["check"].astype(str).str.match(r"forward|grad:")
        & ~df["status"].isin([Status.SKIP, Status.XFAIL])
    ]
    return set(map(tuple, judged[["op", *ITEM]].astype(str).values))


def _table(df: pd.DataFrame) -> list[dict]:
    """The causes (module docstring), as dicts: what `causes` prints and `demoted_lines` reads."""
    if not len(df) or "status" not in df:
        return []
    df = _as_judged(df)
    df = df[df["check"] != "bench"] if "check" in df else df
    if "params" not in df:  # rows written by hand (tests, other tools) may leave the case parameters out
        df = df.assign(params=[{} for _ in range(len(df))])
    bad = df[df["status"].isin(NOT_PASSING)]
    if not len(bad):
        return []
    bad = bad.assign(
        _kind=[_group_kind(r) for r in bad.to_dict("records")],
        _part=[_part(r) for r in bad.to_dict("records")],
        _symptom=[_symptom_of(r) for r in bad.to_dict("records")],
    )
    bad = bad.assign(_status=bad["status"], _crash=bad["_symptom"].isin(CRASHES) & (bad["status"] == Status.ERROR))
    bad = _consequences(bad)
    passing = df[df["status"] == Status.PASS]
    passing_of = {op: rows for op, rows in passing.groupby("op", sort=False)}
    empty = df.iloc[:0]
    # the items a hang's budget skipped (harness/driver/launch.py words them), not those a case or plan skips
    skipped = df[
        (df["status"] == Status.SKIP) & df["message"].astype(str).str.contains("--no-hang-budget", regex=False)
    ]
    skipped_of = {op: rows.drop_duplicates(ITEM) for op, rows in skipped.groupby("op", sort=False)}
    symptoms = []
    for (op, status, kind, part), rows in bad.groupby(["op", "_status", "_kind", "_part"], sort=False):
        rows = rows.sort_values("_crash", ascending=False, kind="stable")  # the crash itself names the line
        symptom = _symptom(
            op, status, kind, rows[rows["_crash"]] if rows["_crash"].any() else rows, passing_of.get(op, empty), rows
        )
        if status != Status.XPASS:  # a stale mark is judged where it ran; a hang's skips say nothing of it
            symptom["condition"] += _not_run(rows, skipped_of.get(op, empty))
        symptoms.append(symptom)
    table = []
    for op in dict.fromkeys(s["ops"][0] for s in symptoms):
        of_op = [s for s in symptoms if s["ops"] == (op,)]
        table += _per_op(of_op, df[df["op"] == op], passing_of.get(op, empty), bad)
    seed_items = _seed_items(df)
    return [
        _demoted(c, bad, seed_items) for c in _across_ops(table, bad, passing)
    ]  # one root per line, then whose rule


def _not_run(rows: pd.DataFrame, skipped: pd.DataFrame) -> str:
    """What a condition cannot say: the op's items at the symptom's topologies that never ran (a hang's budget skips
    the op's other items at its topology, every dtype).  The condition is from the items that ran; those may show
    the symptom too."""
    if not len(skipped):
        return ""
    where = {(r.dp, r.cp, r.tp) for r in rows.itertuples()}
    gone = [r for r in skipped.itertuples() if (r.dp, r.cp, r.tp) in where]
    if not gone:
        return ""
    topologies = sorted({f"dp{r.dp}-cp{r.cp}-tp{r.tp} {r.dtype}" for r in gone})
    return (
        f" (from the items that ran: {len(gone)} item(s) at {', '.join(topologies)} were skipped after a hang "
        f"and may show it too)"
    )


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


def _symptom(
    op: str, status: str, kind: str, rows: pd.DataFrame, passing: pd.DataFrame, all_rows: pd.DataFrame | None = None
) -> dict:
    """One symptom from its rows; `all_rows` adds the checks failing as its consequences (counted, listed)."""
    all_rows = rows if all_rows is None else all_rows
    records = rows.to_dict("records")
    symptom = records[0]["_symptom"]
    found = set(rows["_symptom"])
    if found <= {Symptom.VALUES, Symptom.NONFINITE}:
        kind = "; ".join(x.words for x in (Symptom.VALUES, Symptom.NONFINITE) if x in found)
    signals = (
        {how.strip() for r in records for how in str(r.get("error_type")).split(",")}
        if symptom == Symptom.DIED
        else set()
    )
    if symptom == Symptom.DIED:  # a rank dying: one symptom whatever the signal, which the words then list
        kind = f"{Symptom.DIED.words} ({', '.join(sorted(signals))})"
    worst = max(records, key=_ratio) if status != Status.ERROR else records[0]
    if status != Status.ERROR:  # a model's step: its first divergence (an exception is named by where it was raised)
        worst = model_order.first_row(records, _ratio) or worst
    rerun = (
        worst.get("rerun")
        if isinstance(worst.get("rerun"), str)
        else next((r["rerun"] for r in records if isinstance(r.get("rerun"), str)), None)
    )
    if (rows["check"] == SIGNATURE_CHECK).all() and (rows["case_id"] == "signature").all():  # not a used family's
        condition = "of the module, found before any case ran"
    elif status == Status.XPASS:  # where the mark no longer holds, rather than what separates it from the passing rows
        condition = f"in {_items(rows)} item(s) {_where(rows)}"
    else:
        condition = separating_condition(rows, passing)
    return {
        "op": op,
        "ops": (op,),
        "status": status,
        "kind": kind,
        "symptoms": found,
        "signals": signals,
        "checks": _checks(list(all_rows["check"].unique()), status),
        "count": len(all_rows),
        "condition": condition,
        "worst": _worst_text(worst, status),
        "rerun": rerun,
        "rows": list(rows.index),
        "items": set(map(tuple, rows[ITEM].astype(str).values)),
        "all_checks": list(all_rows["check"].unique()),
        "rules": _rules(all_rows),
        "members": list(all_rows.index),
        "error_key": (worst.get("error_type"), worst.get("error_where")) if symptom in ERRORS else None,
    }


def _rules(rows: pd.DataFrame) -> dict:
    """The rules a cause's rows were judged under ((source, cite) -> None, in order): where each comes from."""
    if "rule_source" not in rows or "rule_cite" not in rows:
        return {}
    pairs = rows[["rule_source", "rule_cite"]].dropna().drop_duplicates()
    return dict.fromkeys(map(tuple, pairs.values))


def rule_text(rules: dict) -> str:
    """'rule: seed: ...' or 'rule: ours, docs/ops/x.md#y' (several: '; '-joined), "" where no row cites one."""
    return "; ".join(f"rule: ours, {cite}" if source == "ours" else f"rule: seed: {cite}" for source, cite in rules)


def _items(rows: pd.DataFrame) -> int:
    return len(rows.drop_duplicates(["op", *ITEM]))


def _where(rows: pd.DataFrame) -> str:
    """'at dp1-cp1-tp2, dp1-cp1-tp4 in float64': the topologies and dtypes of the rows."""
    topologies = sorted({f"dp{r.dp}-cp{r.cp}-tp{r.tp}" for r in rows.itertuples()})
    return f"at {', '.join(topologies)} in {', '.join(sorted(rows['dtype'].unique()))}"


def _checks(checks: list[str], status: str) -> str:
    """A cause's checks for people: a model step's first divergence and what follows from it, else the list."""
    return (status != Status.ERROR and model_order.summary(checks)) or ", ".join(sorted(set(checks)))


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
    model_first = model_order.first_row(rows.to_dict("records"), _ratio) if rows is not None else None
    worst = (
        {"worst": _worst_text(model_first, model_first["status"]), "rerun": model_first.get("rerun")}
        if model_first
        else {}
    )
    return {
        **first,
        **worst,
        "op": _display(ops),
        "ops": tuple(ops),
        "kind": kind,
        "symptoms": set().union(*(s["symptoms"] for s in group)),
        "signals": signals,
        "count": sum(s["count"] for s in group),
        "checks": _checks([c for s in group for c in s["all_checks"]], first["status"]),
        "all_checks": [c for s in group for c in s["all_checks"]],
        "condition": condition,
        "rules": {k: None for s in group for k in s["rules"]},
        "members": [i for s in group for i in s["members"]],
        "rows": [i for s in group for i in s["rows"]],
        "items": set().union(*(s["items"] for s in group)),
        "error_key": first["error_key"] if all(s["error_key"] == first["error_key"] for s in group) else None,
    }


def _is_crash(s: dict) -> bool:
    return bool(s["symptoms"] & set(CRASHES))


def _per_op(symptoms: list[dict], rows: pd.DataFrame, passing: pd.DataFrame, bad: pd.DataFrame) -> list[dict]:
    """The causes of one op from its symptoms (module docstring, 3).  A crash (an exception at one line, a death, a
    hang) is a line of its own with the checks it caused; it never takes in a check that failed where it did not
    cause the failure, and two different crashes stay two lines."""
    failing = [s for s in symptoms if s["status"] in (Status.FAIL, Status.ERROR)]
    warnings = _same_items([s for s in symptoms if s["status"] not in (Status.FAIL, Status.ERROR)], passing, bad)
    crashes = [s for s in failing if _is_crash(s)]
    wrong = [s for s in failing if not _is_crash(s)]
    if len(crashes) == 1 and wrong:  # one trigger on the items for a crash and wrong answers: one bug, two faces
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
    return crashes + _wrong_answers(wrong, rows, passing, bad, crashes) + warnings


def _same_items(warnings: list[dict], passing: pd.DataFrame, bad: pd.DataFrame) -> list[dict]:
    """Warnings with their own lines (a precision or communication finding, a known failure that passes), except
    properties that warn in the same items (failures of rules of ours under --impl, core/rules.py): one cause, as
    they would be as failures (several buffers of one batch left whole after exit)."""
    groups: dict = {}
    for s in warnings:
        key = (frozenset(s["items"]),) if s["status"] == Status.WARN and s["symptoms"] == {Symptom.PROPERTY} else id(s)
        groups.setdefault(key, []).append(s)
    return [
        g[0]
        if len(g) == 1
        else _merge(g, separating_condition(bad.loc[[i for s in g for i in s["rows"]]], passing), bad)
        for g in groups.values()
    ]


def _wrong_answers(
    failing: list[dict], rows: pd.DataFrame, passing: pd.DataFrame, bad: pd.DataFrame, crashes: list[dict]
) -> list[dict]:
    """The lines of an op's checks failing where nothing crashed: one bug showing in several checks is one line,
    an op wrong everywhere does not swallow a symptom with a sharp condition of its own."""
    if len(failing) < 2:
        return failing

    def merged(group: list[dict]) -> dict:
        return (
            group[0]
            if len(group) == 1
            else _merge(group, separating_condition(bad.loc[[i for s in group for i in s["rows"]]], passing), bad)
        )

    # the same items: one cause
    groups: list[list[dict]] = []
    for s in failing:
        same = next((g for g in groups if g[0]["items"] == s["items"]), None)
        if same is None:
            groups.append([s])
        else:
            same.append(s)
    failing = [merged(g) for g in groups]
    if len(failing) == 1:
        return failing

    # the evidence: items that ran, less those a crash explains, where one of these checks was judged
    crashed = set().union(*(c["items"] for c in crashes)) if crashes else set()
    checks = {c for s in failing for c in s["all_checks"]}
    ran = rows[(rows["check"] != SIGNATURE_CHECK) & ~rows["status"].isin([Status.SKIP, Status.XFAIL])]
    ran = ran[~ran[ITEM].astype(str).apply(tuple, axis=1).isin(crashed)] if crashed else ran
    judged = ran[ran["check"].isin(checks)]
    item_rows = judged.drop_duplicates(ITEM)
    item_key = item_rows[ITEM].astype(str).apply(tuple, axis=1)
    items = set(item_key)
    dirty = set(map(tuple, judged[judged["status"].isin(NOT_PASSING)][ITEM].astype(str).values))
    clean = item_rows[~item_key.isin(dirty)]
    if len(clean):  # one trigger on the items for all of them?
        union = set().union(*(s["items"] for s in failing))
        condition = separating_condition(item_rows[item_key.isin(union)], clean, by_check=False)
        if condition.startswith("exactly"):
            return [_merge(failing, condition, bad)]

    checked = {
        check: set(map(tuple, of_check[ITEM].astype(str).values))
        for check, of_check in judged.groupby("check", sort=False)
    }

    def ran_in(s: dict) -> set:
        return set().union(*(checked.get(c, set()) for c in s["all_checks"]))

    # wrong wherever its checks were judged: that does not swallow the op's other symptoms
    everywhere = [s for s in failing if s["items"] >= items or (ran_in(s) and ran_in(s) <= s["items"])]
    if everywhere:
        primary = [s for s in everywhere if s["items"] >= items] or everywhere  # the condition is theirs
        host = merged(primary)
        own = []
        for s in failing:
            if s in primary:
                continue
            if s in everywhere:
                host = _merge([host, s], host["condition"], bad)
                continue
            # a symptom with no sharp condition, or failing in each item its checks ran in (the sum of wrong
            # losses, wrong wherever it is checked), is the same wrong output seen again
            if not s["condition"].startswith("exactly") or ran_in(s) <= s["items"]:
                host = _merge([host, s], host["condition"], bad)
            else:
                own.append(s)
        return [host] + own
    if not len(clean):  # failing somewhere in every item, nowhere in all: one bug
        return [_merge(failing, separating_condition(bad.loc[[i for s in failing for i in s["rows"]]], passing), bad)]
    # otherwise symptoms that share items are one cause
    components: list[list[dict]] = []
    for s in failing:
        joined = [g for g in components if any(s["items"] & t["items"] for t in g)]
        components = [g for g in components if g not in joined] + [[s] + [t for g in joined for t in g]]
    return [merged(g) for g in components]


def _two_crashes(s: dict, t: dict) -> bool:
    return _is_crash(s) and _is_crash(t) and s["kind"] != t["kind"]


def _across_ops(table: list[dict], bad: pd.DataFrame, passing: pd.DataFrame) -> list[dict]:
    """One root, one line (module docstring, 4): the same exception at the same line, the same warning,
    a rank dying under the same condition, in several ops."""

    def key(c: dict):
        if len(c["ops"]) != 1 or len(c["symptoms"]) != 1:
            return None
        symptom = next(iter(c["symptoms"]))
        if c["error_key"] is not None and c["status"] == Status.ERROR:
            return ("raised", c["error_key"])
        if c["status"] == Status.WARN and (symptom == Symptom.COMM or str(symptom).startswith("precision:")):
            return ("warned", c["kind"])
        if symptom == Symptom.DIED and c["signals"] <= CRASH_SIGNALS:  # a crash, not a kill from outside or an exit
            return (Symptom.DIED, c["condition"])
        return None

    groups: dict = {}
    for c in table:
        groups.setdefault(key(c) or ("own", id(c)), []).append(c)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        conditions = {c["condition"] for c in group}
        ops = [op for c in group for op in c["ops"]]
        condition = (
            conditions.pop()
            if len(conditions) == 1
            else separating_condition(bad.loc[[i for c in group for i in c["rows"]]], passing[passing["op"].isin(ops)])
        )
        out.append(_merge(group, condition, bad))
    return out


def _few(checks: str, shown: int = 6) -> str:
    """A line's checks, the first few of a long list: a raise fails every gradient of a model, one check each
    (report.html and every row in results.jsonl keep them all)."""
    names = checks.split(", ")
    return checks if len(names) <= shown + 1 else ", ".join(names[:shown]) + f" and {len(names) - shown} more checks"


def finding_lines(table: pd.DataFrame) -> list[str]:
    """The findings as a person reads them: one line per cause, its worst mismatch and its rerun line."""
    lines = []
    for r in table.itertuples():
        rule = f" [{r.rule}]" if isinstance(getattr(r, "rule", None), str) and r.rule else ""  # seed or ours
        lines.append(f"{r.status.upper()} {r.op}: {r.kind} — {r.condition}; {_few(r.checks)}; {r.count} row(s){rule}")
        lines.append(f"    worst: {r.worst}")
        if isinstance(r.rerun, str):
            lines.append(f"    rerun: {r.rerun}")
    return lines


# ------------------------------------------------------------------------------------------- known failures

KNOWN_COLUMNS = ["op", "reason", "reference", "checks", "count", "items", "where", "rerun"]


def known_failures(df: pd.DataFrame) -> pd.DataFrame:
    """The run's `xfail` rows, one line per known failure (its reason and reference, shardcheck.harness.core.case.KnownFailure):
    the ops and checks it covered, how many rows and items, where (topologies, dtypes) and one rerun line."""
    if not len(df) or "status" not in df:
        return pd.DataFrame(columns=KNOWN_COLUMNS)
    rows = df[df["status"] == Status.XFAIL]
    if not len(rows):
        return pd.DataFrame(columns=KNOWN_COLUMNS)
    rows = rows.assign(
        _reason=rows["xfail_reason"].fillna("") if "xfail_reason" in rows else "",
        _reference=rows["xfail_reference"].fillna("") if "xfail_reference" in rows else "",
    )
    out = []
    for (reason, reference), group in rows.groupby(["_reason", "_reference"], sort=False):
        reruns = group["rerun"].dropna() if "rerun" in group else pd.Series(dtype=object)
        out.append(
            {
                "op": _display(list(dict.fromkeys(group["op"]))),
                "reason": reason,
                "reference": reference,
                "checks": ", ".join(sorted(group["check"].unique())),
                "count": len(group),
                "items": _items(group),
                "where": _where(group),
                "rerun": reruns.iloc[0] if len(reruns) else None,
            }
        )
    return pd.DataFrame(out, columns=KNOWN_COLUMNS)


def known_failure_text(r) -> str:
    """One known failure for people: 'op: reason (reference)'."""
    return f"{r.op}: {r.reason}" + (f" ({r.reference})" if r.reference else "")


def known_failures_line(table: pd.DataFrame) -> str:
    """The known failures of a run in one line, with their reasons (the CLI summary)."""
    total = int(table["count"].sum())
    return f"Known failures ({total} xfail row(s), not failing the run): " + "; ".join(
        f"{known_failure_text(r)}, {r.count} row(s)" for r in table.itertuples()
    )
