"""What went wrong in a row, and a cause, in words: the kind that groups alike rows (numbers blanked), the worst
row of a cause, the findings lines (shardcheck.harness.findings.causes groups; this module says)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.modules import is_path
from shardcheck.harness.core.records import SIGNATURE_CHECK, SYMPTOMS, Status, Symptom
from shardcheck.harness.core.topology import topology_label
from shardcheck.harness.findings import model_order
from shardcheck.harness.findings.conditions import ITEM

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


KEYWORD_CALLS = "rank/signatures.py"  # the file where a call by the seed's parameter names raises (KeywordCalls)
_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def call_by_seed_names(error_key: tuple, signature: str, tested: set) -> bool:
    """Whether an error (its causes.py key: type, file, message) is a call by the seed's parameter names that the
    module's signature line (`signature`, its kind) explains: a TypeError where the harness calls by those names, or,
    for a keyword the line names missing or renamed, outside the modules under test (`tested`: their --impl paths; a
    suite building a class): the module's own call raising it is a root of its own."""
    if error_key[0] != "TypeError":
        return False
    if KEYWORD_CALLS in str(error_key[1]):
        return True
    unexpected = _UNEXPECTED.search(str(error_key[2]))
    named = unexpected is not None and re.search(rf"\b{unexpected[1]}\b", signature.split(" (seed ")[0]) is not None
    paths = [Path(str(spec)).resolve() for spec in tested if isinstance(spec, str) and is_path(spec)]
    outside = bool(paths) and len(paths) == len(tested) and Path(str(error_key[1])).resolve() not in paths
    return named and outside


def symptom_of(row) -> str | None:
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
    symptom, check, status = symptom_of(row), str(row["check"]), row["status"]
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


def group_kind(row) -> str:
    """kind_of, except that wrong and non-finite values of one check are one symptom (the numbers are wrong)."""
    return Symptom.VALUES.words if symptom_of(row) in (Symptom.VALUES, Symptom.NONFINITE) else kind_of(row)


def check_part(row) -> str:
    """A wrong value is a symptom per check (the forward and a gradient may be wrong under different
    conditions); an exception, a death or a hang fails the whole item."""
    return str(row["check"]) if symptom_of(row) in PER_CHECK else ""


def err_ratio(row) -> float:
    r = row.get("err_ratio")
    return math.inf if r is None or (isinstance(r, float) and math.isnan(r)) else float(r)


def _ranks(ranks) -> str:
    ranks = list(ranks) if isinstance(ranks, (list, tuple)) else []
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def worst_text(row, status: str, limit: int = 300) -> str:
    """The worst row of a cause, for people: who raised, died or hung, or the worst mismatch; then its item."""
    symptom = symptom_of(row)
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
        ratio = err_ratio(row)
        text = (f"err/budget {ratio:.3g}: " if status != Status.ERROR and math.isfinite(ratio) else "") + str(
            row.get("message") or ""
        )
        if model_order.step_order(str(row.get("check"))) is not None:  # which module or parameter the numbers are of
            text = f"[{row['check']}] {text}"
    limit = limit * 2 if symptom in (Symptom.HUNG, Symptom.DIED) else limit  # where each rank was takes room
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    if symptom == Symptom.SIGNATURE:  # found before any rank ran: of the module, at no topology or dtype
        return f"{text} ({row['op']} [{row.get('case_id')}] in the module under test {row.get('impl')})"
    return f"{text} ({row['op']} [{row.get('case_id')}] {topology_label(row)} {row['dtype']})"


def display(ops: list[str]) -> str:
    """One op as it is; several of one family as family.{A, B}."""
    if len(ops) == 1:
        return ops[0]
    families = {op.split(".", 1)[0] for op in ops}
    if len(families) == 1:
        return f"{families.pop()}.{{{', '.join(op.split('.', 1)[1] for op in ops)}}}"
    return ", ".join(ops)


def rule_text(rules: dict) -> str:
    """'rule: seed: ...' or 'rule: ours, docs/ops/x.md#y' (several: '; '-joined), "" where no row cites one."""
    return "; ".join(f"rule: ours, {cite}" if source == "ours" else f"rule: seed: {cite}" for source, cite in rules)


def item_count(rows: pd.DataFrame) -> int:
    return len(rows.drop_duplicates([c for c in ("op", *ITEM) if c in rows]))  # (ep: absent from older rows)


def where_text(rows: pd.DataFrame) -> str:
    """'at dp1-cp1-tp2, dp1-cp1-tp4 in float64': the topologies and dtypes of the rows."""
    topologies = sorted({topology_label(r) for r in rows.to_dict("records")})
    return f"at {', '.join(topologies)} in {', '.join(sorted(rows['dtype'].unique()))}"


def checks_text(checks: list[str], status: str, factor: str = "") -> str:
    """A cause's checks for people: a model step's first divergence, the one factor of every wrong tensor if any
    (`factor`), and what follows from it; else the list."""
    return (status != Status.ERROR and model_order.summary(checks, factor)) or ", ".join(sorted(set(checks)))


def few_checks(checks: str, shown: int = 6) -> str:
    """A line's checks, the first few of a long list: a raise fails every gradient of a model, one check each
    (report.html and every row in results.jsonl keep them all)."""
    names = checks.split(", ")
    return checks if len(names) <= shown + 1 else ", ".join(names[:shown]) + f" and {len(names) - shown} more checks"


def finding_lines(table: pd.DataFrame) -> list[str]:
    """The findings as a person reads them: one line per cause, its worst mismatch and its rerun line."""
    lines = []
    for r in table.itertuples():
        rule = f" [{r.rule}]" if isinstance(getattr(r, "rule", None), str) and r.rule else ""  # seed or ours
        lines.append(
            f"{r.status.upper()} {r.op}: {r.kind} — {r.condition}; {few_checks(r.checks)}; {r.count} row(s){rule}"
        )
        lines.append(f"    worst: {r.worst}")
        if isinstance(r.rerun, str):
            lines.append(f"    rerun: {r.rerun}")
    return lines
