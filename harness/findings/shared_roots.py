"""Roots that span ops whatever each op's own symptoms say (shardcheck.harness.findings.causes, module docstring 4):
a rule of ours that input outside the seed brought in, and an environment without the accelerator the code needs.

- **A rule of ours, one line.**  Under `--impl`, a wrong answer on input only our rule describes (targets outside
  [0, V), a temperature the seed leaves to the caller, a vocab TP does not split where the seed's split is even:
  core/citations.py `OutsideSeed`) is a failure, as any silent wrong answer; but what it shows is our opinion of
  that input, the same in every op that took it.  Such rows are kept apart from the op's seed-rule rows (never merged
  with a defect the seed's rules find) and one line per rule names every op (the float64-in-float32 warning does the
  same for a precision rule).
- **A NaN under one trigger.**  Non-finite values where the golden has none, in several ops, exactly under the same
  condition on the mesh and the inputs (the checks aside: "at tp ≥ 2, when neg_inf ≥ 0.3"), are one root: a helper
  the ops share (gather_logits_at_global_indices inside get_distillation_topk_logprobs_from_logits).  Only a trigger
  that names a mesh dim counts; a line that no condition separates is never merged so.
- **One rule of ours, one line, whatever each op did.**  Once each line's rule is weighed (causes.py, module
  docstring 5), the lines judged under one rule of ours alone (beside the harness's own: the communication contract,
  the precision of each dtype) are one line across ops: the wrong answers on that input (FAIL, as any silent wrong
  answer) and the raises on it that the evidence demoted (`warn` rows, loud being acceptable there).  What they show
  is one opinion of ours on one input the seed does not describe (ids outside [0, V): some ops raise, some answer
  wrong); no line with a rule of the seed's is ever merged so.
- **The environment.**  An exception saying the process has no CUDA device, driver or pinned-memory allocator (a
  `pin_memory=True` buffer, a `.cuda()` call on a CPU run) is one root whatever its type and line: code written for
  a GPU run on a CPU box.  It stays an error (the run did not check those paths), on one line naming the ops.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pandas as pd

from shardcheck.harness.core.citations import COMM_RULE, PRECISION_RULE, RuleSource
from shardcheck.harness.core.modules import is_ours
from shardcheck.harness.core.records import Status, Symptom
from shardcheck.harness.findings.wording import blank_numbers

OURS_RULE_PREFIX = "wrong on input only our rule describes: "  # a merged ours-rule line's kind begins so
ENVIRONMENT_PREFIX = "needs a GPU, the run has none: "  # an environment line's kind begins so
EXACTLY = "exactly "  # a separating condition begins so (findings/conditions.py)
MESH = re.compile(r"at [a-z_·]+ [≥≤=≠<>]")  # a predicate on the mesh ("at tp ≥ N", "at dp·cp ≥ N")
CHECK_PREDICATES = ("in forward", "in grad:", "in the gradients", "in the outputs", "in property:")

# What an exception says when the process lacks the accelerator the code asks for (torch's own messages).
NO_ACCELERATOR = (
    "not compiled with cuda enabled",
    "requires a cuda or other accelerator backend",
    "no pinned memory allocator",
    "no cuda gpus are available",
    "found no nvidia driver",
)


def ours_rule_of(bad: pd.DataFrame) -> list[str]:
    """Per non-passing row, the cite of the rule of ours it failed under as a silent wrong answer of a module under
    --impl ("" for every other row: seed rules, our own implementations, errors, warnings, consequences of a crash)."""
    if "rule_source" not in bad or "rule_cite" not in bad or "impl" not in bad:
        return [""] * len(bad)
    return [
        str(r["rule_cite"])
        if r["_status"] == Status.FAIL
        and r["rule_source"] == RuleSource.OURS
        and isinstance(r["impl"], str)
        and not is_ours(r["impl"])
        else ""
        for r in bad[["_status", "rule_source", "rule_cite", "impl"]].to_dict("records")
    ]


def by_rule(symptoms: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """`symptoms` of one op split: those judged under the seed's rules, and per rule of ours the others.  A wrong
    answer under a rule of ours stays with the seed's where the seed's cases get that check wrong the same way (an
    averaged gradient, wrong on masked targets and on plain ones; where it shows on one rank, only if theirs does too:
    a CP gradient zeroed at cp ≥ 2 and a masked target's gradient wrong on every mesh are two roots), or where it
    never shows on one rank and the seed's
    cases get that check wrong at every topology where it shows (CP chunks swapped: wrong values on plain ids and NaN
    where masked ids meet the swapped rows, both at cp 2 alone): the op's sharding defect, shown on our input as
    well.  An opinion of ours on an input shows on one rank too, where nothing is sharded.  A seed symptom whose
    trigger is an input (a −inf logit: "when neg_inf ≥ 0.3") says nothing of where the sharding is wrong: the place
    is read from those whose trigger is the mesh alone (uneven shards wrong at TP 2 beside a NaN on −inf logits at TP
    2 are two roots)."""
    seed = [s for s in symptoms if not s["ours_rule"]]
    seen: dict[tuple, set] = {}  # per (kind, check), the topologies where the seed's cases get it wrong so
    where: dict[str, set] = {}  # per check, the topologies where the seed's cases get it wrong
    for s in seed:
        # a seed symptom whose trigger is a case parameter (a −inf logit) is not where a sharding defect shows
        mesh_only = all(MESH.match(p) for p in _trigger(s["condition"]))
        for check in s["all_checks"]:
            seen.setdefault((s["kind"], check), set()).update(_topologies(s))
            if mesh_only:
                where.setdefault(check, set()).update(_topologies(s))
    ours: dict[str, list[dict]] = {}
    for s in symptoms:
        if not s["ours_rule"]:
            continue
        topologies = _topologies(s)
        sharded_only = not any(_one_rank(t) for t in topologies)
        # the same kind on the same check, and on one rank only where the seed's cases are wrong on one rank too
        same_way = any(
            (s["kind"], check) in seen and (sharded_only or any(map(_one_rank, seen[(s["kind"], check)])))
            for check in s["all_checks"]
        )
        same_place = sharded_only and any(topologies <= where.get(check, set()) for check in s["all_checks"])
        if same_way or same_place:
            seed.append({**s, "ours_rule": ""})  # (never merged across ops as an opinion)
        else:
            ours.setdefault(s["ours_rule"], []).append(s)
    return seed, ours


def warn_twins(failing: list[dict], warnings: list[dict]) -> tuple[dict[int, list[dict]], list[dict]]:
    """Per failing symptom (by `id`), the warnings that are its twins, and the warnings left.  A property that only
    warns because its rule is ours alone (an input the seed does not describe: core/rules.py) where the same property
    fails the same way under the seed's rule on another case of the op is one root (a DDP and a wrapper with
    `no_sync()` both syncing on every micro-batch): one line, listing both rules, at the failure's status."""
    failed = {s["kind"]: s for s in failing if s["status"] == Status.FAIL and s["symptoms"] == {Symptom.PROPERTY}}
    twins: dict[int, list[dict]] = {}
    left = []
    for w in warnings:
        ours = bool(w["rules"]) and all(source == RuleSource.OURS for source, _ in w["rules"])
        twin = failed.get(w["kind"]) if w["status"] == Status.WARN and w["symptoms"] == {Symptom.PROPERTY} else None
        if twin is not None and ours:
            twins.setdefault(id(twin), []).append(w)
        else:
            left.append(w)
    return twins, left


def _topologies(symptom: dict) -> set[tuple]:
    """The mesh coordinates of a symptom's items (conditions.ITEM: case, the mesh dims, dtype)."""
    return {item[1:-1] for item in symptom["items"]}


def _one_rank(topology: tuple) -> bool:
    """Whether no mesh dim of a topology is over 1 (the items hold them as strings: "1.0", "nan" where a dim was
    not recorded, "0" on a row of no item)."""
    return all(not size.replace(".", "", 1).isdigit() or float(size) <= 1 for size in topology)


def ours_only(line: dict) -> bool:
    """Whether every row of a line is judged under rules of ours alone."""
    return all(source == RuleSource.OURS for source, _ in line["rules"])


def apart_by_rule(lines: list[dict], bad: pd.DataFrame) -> list[list[dict]]:
    """One exception's lines across ops (one message, one file) as roots: an op's line on input only our rules feed
    stays apart from another op's line on the seed's raising at other lines of the file, however alike their
    messages; one op's lines stay together, and so do lines raising at a line they share (a helper they call)."""
    raised_at = bad["error_where"].astype(str) if "error_where" in bad else pd.Series("", index=bad.index)
    where = {id(c): set(raised_at.loc[c["rows"]]) for c in lines}
    parts: list[list[dict]] = []
    for line in lines:
        near = [
            p
            for p in parts
            if any(
                q["op"] == line["op"] or ours_only(q) == ours_only(line) or where[id(q)] & where[id(line)] for q in p
            )
        ]
        parts = [p for p in parts if p not in near] + [[q for p in near for q in p] + [line]]
    return sorted(parts, key=lambda p: min(lines.index(q) for q in p))


def same_rules(lines: list[dict]) -> bool:
    """Whether `lines` are all judged under rules of ours alone, or none is: a crash on input only our rule feeds and
    a wrong answer the seed's rules find are two roots, however one condition covers their items."""
    return len({ours_only(c) for c in lines}) == 1


def _trigger(condition: str) -> tuple[str, ...]:
    """A condition's predicates but the checks it names, numbers blanked ("exactly in forward:student, at tp ≥ 2,
    when neg_inf ≥ 0.3" -> ("at tp ≥ N", "when neg_inf ≥ N")); () where it does not separate."""
    if not condition.startswith(EXACTLY):
        return ()
    words = re.sub(r",? at (every topology )?\(?dp\d[^;]*", "", condition[len(EXACTLY) :])  # where, not a trigger
    parts = [p.strip() for p in words.split(";")[0].split(",")]
    return tuple(blank_numbers(p) for p in parts if p and not p.startswith(CHECK_PREDICATES))


def is_environment(error_key) -> bool:
    """Whether an exception (type, file, message) says the process lacks the accelerator the code asks for."""
    return error_key is not None and any(text in str(error_key[-1]).lower() for text in NO_ACCELERATOR)


def shared_key(c: dict):
    """The key of a line that is one root with other ops' lines of the same key (None: none of these roots)."""
    if c["status"] == Status.FAIL and c.get("ours_rule"):
        return ("ours rule", c["ours_rule"])
    if c["status"] == Status.ERROR and is_environment(c.get("error_key")):
        return ("environment",)
    trigger = _trigger(c["condition"])
    if (
        c["status"] == Status.FAIL
        and c["symptoms"] == {Symptom.NONFINITE}
        and any(p.startswith("at ") for p in trigger)
    ):
        return ("non-finite", trigger)  # a NaN under one trigger of the mesh in several ops: a helper they share
    return None


def worded(kind: str, key) -> str:
    """A merged line's kind, saying which of these roots it is."""
    if key[0] == "non-finite":
        return kind
    prefix = OURS_RULE_PREFIX if key[0] == "ours rule" else ENVIRONMENT_PREFIX
    return kind if kind.startswith(prefix) else prefix + kind


HARNESS_RULES = {(str(r.source), r.cite) for r in (COMM_RULE, PRECISION_RULE)}  # beside any input's rule


def input_rule(c: dict) -> str:
    """The one rule of ours a line is judged under beside the harness's own ("" if none, or if it has a rule of the
    seed's): a wrong answer on input only that rule describes, or a raise on it demoted to `warn`."""
    if c["status"] == Status.FAIL and c.get("ours_rule") and c["kind"].startswith(OURS_RULE_PREFIX):
        return c["ours_rule"]
    if not c.get("demoted"):
        return ""
    rules = {(str(source), cite) for source, cite in c["rules"]} - HARNESS_RULES
    sources = {source for source, _ in rules}
    return next(iter(rules))[1] if len(rules) == 1 and sources == {str(RuleSource.OURS)} else ""


def one_line_per_input_rule(table: list[dict], merge: Callable[[list[dict]], dict]) -> list[dict]:
    """`table` with the lines of each rule of ours (`input_rule`) merged into one by `merge` (module docstring): its
    status the worst of them, its demoted raises' rows (`demoted_members`) still written `warn`."""
    groups: dict = {}
    for c in table:
        groups.setdefault(input_rule(c) or id(c), []).append(c)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append({**group[0], "kind": _said_once(group[0]["kind"])} if input_rule(group[0]) else group[0])
            continue
        group = sorted(group, key=lambda c: -Status(c["status"]).order)  # the failure's words first
        demoted = [i for c in group if c.get("demoted") for i in c.get("demoted_members", c["members"])]
        merged = merge(group)
        out.append({**merged, "kind": _said_once(merged["kind"]), "demoted": bool(demoted), "demoted_members": demoted})
    return out


def _said_once(kind: str) -> str:
    """A wrong-answer line of a rule of ours in words: the prefix once, each symptom once ("...: wrong values;
    non-finite values differ"), where merging lines of several ops repeated them."""
    if not kind.startswith(OURS_RULE_PREFIX):
        return kind
    parts = [p[len(OURS_RULE_PREFIX) :] if p.startswith(OURS_RULE_PREFIX) else p for p in kind.split("; ")]
    return OURS_RULE_PREFIX + "; ".join(dict.fromkeys(parts))
