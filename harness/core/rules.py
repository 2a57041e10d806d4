"""A check's verdict under its rule (Case.rule_of): where the rule comes from goes on the row, and under `--impl` a
failure of a rule that is ours alone is a `warn` naming it, unless it is a silent wrong answer.

The seed is the contract someone else's implementation was written to; docs/ops fixes what it leaves open (loud or
right on input it does not describe, what a size-1 group does, which collectives are enough).  Holding a third-party
module to our choice as if it were the seed's would bury its real defects among opinions, so such a failure warns,
citing the rule.  A wrong value or a NaN returned on input the op accepted stays a failure (the op answered, and the
answer is wrong), and says that the input is outside the seed's stated shapes."""

from __future__ import annotations

from shardcheck.harness.core.citations import PRECISION_RULE, Rule, RuleSource
from shardcheck.harness.core.records import Status, Symptom

__all__ = ["RULE_FIELDS", "SILENT_WRONG", "under_rule"]

RULE_FIELDS = ("rule_source", "rule_cite")
SILENT_WRONG = (Symptom.VALUES, Symptom.NONFINITE)  # the op returned, and the answer is wrong


def under_rule(rule: Rule | None, status: str, fields: dict, third_party: bool) -> tuple[str, dict]:
    """(status, fields) of a check judged under `rule`: the rule's fields added, an ours-only failure of a third-party
    module downgraded to `warn` (a silent wrong answer excepted, which says the input is outside the seed's shapes)."""
    if str(fields.get("symptom") or "").startswith("precision:"):  # a precision finding: our rule, not the check's
        rule = PRECISION_RULE
    if rule is None:
        return status, fields
    fields = {**fields, "rule_source": str(rule.source), "rule_cite": rule.cite}
    if not third_party or rule.source != RuleSource.OURS or status != Status.FAIL:
        return status, fields
    message = str(fields.get("message") or "")
    if fields.get("symptom") in SILENT_WRONG:
        note = f"a wrong answer on input outside the seed's stated shapes, which the op accepted ({rule})"
        return status, {**fields, "message": "; ".join(m for m in (message, note) if m)}
    note = f"the rule is ours, not the seed's ({rule})"
    return Status.WARN, {**fields, "message": "; ".join(m for m in (message, note) if m)}
