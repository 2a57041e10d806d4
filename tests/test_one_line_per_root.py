"""One line per root across symptom kinds, dtypes and rule sources (issue 42, second pass, items 1 to 3): a wrong value
returned in the wrong dtype is a wrong value, so the float64 rows of an op wrong in every dtype are on its one line
(not a "wrong dtype" line beside it) and under a rule of ours stay a FAIL (a silent wrong answer)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import torch
from helpers import BROKEN, IMPLS, shardcheck

from shardcheck import PrecisionOnly
from shardcheck.harness.core.records import SIGNATURE_CHECK, Symptom
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.shared_roots import ENVIRONMENT_PREFIX, OURS_RULE_PREFIX
from shardcheck.harness.findings.verdicts import demote
from shardcheck.harness.findings.wording import finding_lines
from shardcheck.suites._model_utils_checks import topk_values_exact


def test_a_wrong_value_in_the_wrong_dtype_is_one_line_with_the_other_dtypes(tmp_path):
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils._compute_distributed_log_softmax",
        "--case",
        "b4s4v24-ties",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64,float32",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'float32_log_softmax_no_sum.py'}",
        out=tmp_path,
    )
    assert run.returncode == 1, run.stdout
    failed = run.failed()
    assert set(failed["dtype"]) == {"float64", "float32"}
    assert set(failed["symptom"]) == {Symptom.VALUES}  # the float64 row too, its message naming the dtype
    assert failed[failed["dtype"] == "float64"]["message"].str.contains("dtype float32, expected float64").all()
    assert len(run.causes) == 1, run.causes.to_string()
    line = run.causes.iloc[0]
    assert line["status"] == "fail" and line["kind"] == "wrong values" and line["count"] == 2


def test_dtensor_ids_are_built_on_the_cp_mesh_as_upstreams_callers_build_them(tmp_path):
    """At DP 2 a DTensor of input ids is each DP rank's own batch piece: `full_tensor()` gives that piece (on the
    whole mesh with DP Shard(0) it gave the global batch, and an honest module failed)."""
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.get_logprobs_from_vocab_parallel_logits",
        "--case",
        "dtensor_ids-*",
        "--topology",
        "dp=2,cp=1,tp=1",
        "--dtype",
        "float64",
        "--impl",
        f"model_utils={IMPLS / 'full_tensor_ids_model_utils.py'}",
        out=tmp_path,
    )
    assert run.returncode == 0, run.stdout
    assert (run.rows["check"] == "forward").sum() == 2  # the masked case and the seed-rule one


def test_a_crash_on_dtensor_ids_is_an_error_not_a_raise_on_our_rule(tmp_path):
    """DTensor ids run on a seed-rule case (ids in [0, V)) beside the masked one: a module refusing the DTensor
    crashes there too, and its one line stays an error (it was a warn, "raises on input only our rule feeds")."""
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.get_logprobs_from_vocab_parallel_logits",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'dtensor_ids_refused.py'}",
        out=tmp_path,
        strict=False,
    )
    assert run.returncode == 1, run.stdout
    assert len(run.causes) == 1, run.causes.to_string()
    line = run.causes.iloc[0]
    assert line["status"] == "error" and line["kind"].startswith("TypeError: input_ids must be a torch.Tensor")
    assert "rule: seed" in line["rule"]


def _row(check: str, status: str, **fields) -> dict:
    return {
        "op": fields.pop("op", "model_utils.F"),
        "case_id": fields.pop("case_id", "c"),
        "dp": 1,
        "cp": fields.pop("cp", 1),
        "tp": fields.pop("tp", 1),
        "dtype": "float64",
        "check": check,
        "status": status,
        "message": fields.pop("message", ""),
        "params": fields.pop("params", {}),
        "culprit_ranks": [0],
        "blocked_ranks": [],
        "phase": "forward",
        **fields,
    }


def test_a_missing_seed_parameter_and_the_typeerror_of_every_call_passing_it_are_one_line():
    missing = "signature: missing parameter(s) w (seed F(x, w), under test F(x))"
    rows = [_row(SIGNATURE_CHECK, "fail", case_id="signature", symptom=Symptom.SIGNATURE, message=missing)]
    raised = dict(
        symptom=Symptom.EXCEPTION,
        error_type="TypeError",
        error_message="F() got an unexpected keyword argument 'w'",
        error_where="shardcheck/harness/rank/signatures.py:252",
    )
    rows += [_row(check, "error", tp=tp, **raised) for tp in (1, 2) for check in ("forward", "grad:x")]
    rows += [_row("forward", "pass", case_id="other")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1, finding_lines(table)
    line = table.iloc[0]
    assert line["status"] == "error" and line["count"] == 5
    assert line["kind"].startswith(missing) and "TypeError: F() got an unexpected keyword argument 'w'" in line["kind"]
    assert line["condition"] == "of the module, found before any case ran"
    # a TypeError the module raises itself is its own root
    own = [{**r, "error_where": "their_model_utils.py:9"} if r["status"] == "error" else r for r in rows]
    assert len(causes(pd.DataFrame(own))) == 2
    # a suite building the op by that name (a class's constructor) is a call by the seed's names too; the module
    # under test (--impl) calling it so is not
    tested = [{**r, "impl": "their_model_utils.py"} for r in own]
    assert len(causes(pd.DataFrame(tested))) == 2
    by_suite = [{**r, "error_where": "suites/model_utils.py:70"} if r["status"] == "error" else r for r in tested]
    assert len(causes(pd.DataFrame(by_suite))) == 1


def test_a_rank_dying_of_one_signal_in_one_phase_is_one_line_across_ops_whatever_their_conditions():
    """An op and its wrapper killing gloo with an in-place all_reduce (SIGABRT in the backward): one line, though
    each op's own condition differs (one at cp ≥ 2, the other at cp ≥ 2 for one seq_dim only)."""

    def died(op, cp, seq_dim, phase="backward"):
        return _row(
            "grad:x",
            "error",
            op=op,
            cp=cp,
            case_id=f"d{seq_dim}",
            params={"seq_dim": seq_dim},
            symptom=Symptom.DIED,
            error_type="SIGABRT",
            phase=phase,
        )

    def passed(op, cp, seq_dim):
        return _row("grad:x", "pass", op=op, cp=cp, case_id=f"d{seq_dim}", params={"seq_dim": seq_dim})

    wrapper, op = "model_utils.allgather", "model_utils.AllGather"
    rows = [died(op, 2, d) for d in (0, 1)] + [passed(op, 1, d) for d in (0, 1)]
    rows += [died(wrapper, 2, 0), passed(wrapper, 2, 1), passed(wrapper, 1, 0)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1, finding_lines(table)
    assert table.iloc[0]["kind"] == "a rank died (SIGABRT)" and set(table.iloc[0]["ops"]) == {op, wrapper}
    # the wrapper's float32 item dying while judging, after its backward returned (the heap the in-place all_reduce
    # corrupted; NeMo-RL's AllGatherCPTensor once its backward runs on a CPU machine): the same root, one line
    judged = [
        {**r, "phase": "judging", "error_type": "SIGSEGV"}
        for r in rows
        if r["op"] == wrapper and r["status"] == "error"
    ]
    table = causes(pd.DataFrame([r for r in rows if r["op"] != wrapper or r["status"] != "error"] + judged))
    assert len(table) == 1 and set(table.iloc[0]["ops"]) == {op, wrapper}, finding_lines(table)
    # a death in another phase is another root
    rows += [died("model_utils.Forward", 2, 0, phase="forward"), passed("model_utils.Forward", 1, 0)]
    assert len(causes(pd.DataFrame(rows))) == 2
    # unless a death shares a phase with each (the wrapper dying in the forward too at another topology)
    rows += [{**died(wrapper, 2, 1, phase="forward"), "dp": 2, "cp": 1}]
    assert len(causes(pd.DataFrame(rows))) == 1, finding_lines(causes(pd.DataFrame(rows)))


def test_a_case_with_ids_only_our_rule_feeds_is_judged_under_our_rule_in_every_check():
    """Issue 42, item 2: the rule source is decided by the case's inputs, not by the check: a case with targets
    outside [0, V) (masked) cites our rule for its properties too, not the seed sentence a property has elsewhere."""
    from shardcheck.harness.core.citations import RuleSource
    from shardcheck.suites import model_utils

    cases = model_utils.cases(quick=False)
    masked = [c for c in cases if c.params.get("masked") and c.bad_input is None and c.rules]
    assert masked
    for case in masked:
        for pattern in case.rules:
            assert case.rule_of(pattern.replace("*", "x")).source == RuleSource.OURS, (case.case_id, pattern)
    plain = [c for c in cases if not c.params.get("masked") and "property:chunked_equals_unchunked" in c.rules]
    assert plain and plain[0].rule_of("property:chunked_equals_unchunked").source == RuleSource.SEED


def test_one_unhandled_input_reaching_several_lines_of_a_module_is_one_line():
    """A DTensor target the module never unwraps raises the same error at three lines (three code paths, two ops):
    one root, one line naming both ops; the same message from another file is another root."""
    mixed = dict(symptom=Symptom.EXCEPTION, error_type="RuntimeError", error_message="got mixed Tensor and DTensor")
    rows = [
        _row("forward", "error", op=op, case_id=case, error_where=f"their_model_utils.py:{line}", **mixed)
        for op, case, line in (("model_utils.A", "a1", 127), ("model_utils.A", "a2", 390), ("model_utils.B", "b", 527))
    ]
    rows += [_row("forward", "pass", op=op, case_id="plain") for op in ("model_utils.A", "model_utils.B")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1 and table.iloc[0]["ops"] == ("model_utils.A", "model_utils.B"), finding_lines(table)
    rows += [_row("forward", "error", op="model_utils.C", case_id="c", error_where="torch/other.py:9", **mixed)]
    rows += [_row("forward", "pass", op="model_utils.C", case_id="plain")]
    assert len(causes(pd.DataFrame(rows))) == 2


THEIRS = "their_model_utils.py"  # an --impl module: a rule of ours weighs
MASKED = "docs/ops/README.md#ids-outside-the-vocab"


def _judged(check: str, status: str, source: str, cite: str, **fields) -> dict:
    return _row(check, status, impl=THEIRS, rule_source=source, rule_cite=cite, **fields)


def test_wrong_answers_under_one_rule_of_ours_are_one_line_across_ops_apart_from_the_seeds():
    """Issue 42: the gradient at masked targets (an opinion of ours: the seed says nothing of ids outside [0, V)) wrong
    in three ops is one FAIL line naming them, never merged with a wrong value the seed's rule finds in one of them;
    a second rule of ours (a temperature) is a line of its own."""
    seed_rule = "the op's documented result (its docstring and signature)"
    wrong = dict(symptom=Symptom.VALUES, message="|err| 0.9 > budget")
    rows = []
    for op in ("model_utils.A", "model_utils.B", "model_utils.C"):
        rows += [
            _judged("grad:logits", "fail", "ours", MASKED, op=op, case_id="masked", params={"masked": 0.2}, **wrong)
        ]
        rows += [_judged("forward", "pass", "ours", MASKED, op=op, case_id="masked", params={"masked": 0.2})]
        rows += [_judged(c, "pass", "seed", seed_rule, op=op, case_id="plain") for c in ("forward", "grad:logits")]
    rows += [_judged("forward", "fail", "seed", seed_rule, op="model_utils.A", case_id="ties", tp=2, **wrong)]
    rows += [_judged("forward", "pass", "seed", seed_rule, op="model_utils.A", case_id="ties")]
    hot = "docs/ops/model_utils.md#sampling-temperature"
    rows += [
        _judged("forward", "fail", "ours", hot, op="model_utils.B", case_id="hot", params={"temperature": 0.7}, **wrong)
    ]
    table = causes(pd.DataFrame(rows))
    lines = finding_lines(table)
    assert len(table) == 3, lines
    masked = table[table["rule"].str.contains(MASKED, regex=False)]
    assert len(masked) == 1 and masked.iloc[0]["ops"] == ("model_utils.A", "model_utils.B", "model_utils.C"), lines
    assert masked.iloc[0]["status"] == "fail" and masked.iloc[0]["kind"].startswith(OURS_RULE_PREFIX)
    assert masked.iloc[0]["count"] == 3
    seed_line = table[table["rule"].str.contains("seed")]
    assert len(seed_line) == 1 and seed_line.iloc[0]["ops"] == ("model_utils.A",) and seed_line.iloc[0]["count"] == 1
    assert "tp ≥ 2" in seed_line.iloc[0]["condition"], lines
    assert len(table[table["rule"].str.contains(hot, regex=False)]) == 1


def test_our_own_implementations_wrong_under_a_rule_of_ours_keep_their_lines_per_op():
    """Our implementations are held to our rules: their wrong answers are defects of each op, not one opinion."""
    wrong = dict(symptom=Symptom.VALUES, message="|err| 0.9 > budget", rule_source="ours", rule_cite=MASKED)
    rows = [
        _row("grad:logits", "fail", op=op, case_id="masked", impl=None, **wrong)
        for op in ("model_utils.A", "model_utils.B")
    ]
    rows += [
        _row("grad:logits", "pass", op=op, case_id="plain", impl=None) for op in ("model_utils.A", "model_utils.B")
    ]
    assert len(causes(pd.DataFrame(rows))) == 2


def test_code_that_needs_a_gpu_is_one_environment_line_whatever_the_exception():
    """A pinned-memory buffer and a `.cuda()` call on a CPU run: two exceptions, two lines of the module, one root
    (the machine has no GPU), one ERROR line naming both ops; another exception stays its own line."""
    rows = [
        _row(
            "forward",
            "error",
            op="model_utils.A",
            case_id="a",
            symptom=Symptom.EXCEPTION,
            error_type="RuntimeError",
            error_message="pin_memory=True requires a CUDA or other accelerator backend; no pinned memory allocator "
            "is available on this system.",
            error_where=f"{THEIRS}:1170",
        ),
        _row(
            "forward",
            "error",
            op="model_utils.B",
            case_id="b",
            symptom=Symptom.EXCEPTION,
            error_type="AssertionError",
            error_message="Torch not compiled with CUDA enabled",
            error_where="torch/cuda/__init__.py:403",
        ),
        _row(
            "forward",
            "error",
            op="model_utils.B",
            case_id="c",
            symptom=Symptom.EXCEPTION,
            error_type="KeyError",
            error_message="'x'",
            error_where=f"{THEIRS}:9",
        ),
    ]
    rows += [_row("forward", "pass", op=op, case_id="plain") for op in ("model_utils.A", "model_utils.B")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 2, finding_lines(table)
    gpu = table[table["kind"].str.startswith(ENVIRONMENT_PREFIX)]
    assert (
        len(gpu) == 1 and gpu.iloc[0]["ops"] == ("model_utils.A", "model_utils.B") and gpu.iloc[0]["status"] == "error"
    )


def test_a_nan_under_one_trigger_of_the_mesh_in_two_ops_is_one_line_another_trigger_is_another():
    """gather_logits_at_global_indices and get_distillation_topk_logprobs_from_logits (which calls it) return NaN
    exactly at tp ≥ 2 on −inf logits: one root, one line; a NaN of a third op under another trigger keeps its own."""
    nan = dict(symptom=Symptom.NONFINITE, message="NaN where the golden is finite")
    rows = []
    for op, check in (("model_utils.G", "forward"), ("model_utils.D", "forward:student"), ("model_utils.E", "forward")):
        for tp in (1, 2):
            for case, draw in (("neg", {"neg_inf": 0.3}), ("plain", {})):
                failing = tp == 2 and case == "neg" if op != "model_utils.E" else case == "plain" and tp == 1
                rows += [_row(check, "fail" if failing else "pass", op=op, case_id=case, tp=tp, params=draw, **nan)]
    table = causes(pd.DataFrame(rows))
    lines = finding_lines(table)
    assert len(table) == 2, lines
    shared = table[table["ops"].apply(len) == 2].iloc[0]
    assert shared["ops"] == ("model_utils.G", "model_utils.D") and "at tp ≥ 2" in shared["condition"], lines


def test_a_crash_on_input_only_our_rule_feeds_and_a_seed_wrong_answer_are_two_lines():
    """An op raising on a rank holding no vocab entries (ours) and returning NaN on −inf logits (the seed's): one
    condition covers both items ("at tp ≥ 2, when chunk_size ≤ 3"), but they are two roots, so the wrong answer keeps a
    line of its own (it was folded into the crash's line as "one bug, two faces")."""
    seed_rule = "the op's documented result (its docstring and signature)"
    uneven = "docs/ops/model_utils.md#uneven-vocab-shards"
    raised = dict(symptom=Symptom.EXCEPTION, error_type="IndexError", error_message="amax(): empty", phase="forward")
    params = {"v1": {"V": 1, "chunk_size": 3}, "neg": {"V": 24, "chunk_size": 1}, "big": {"V": 48, "chunk_size": 64}}
    rows = [
        _judged(c, "error", "ours", uneven, case_id="v1", tp=2, params=params["v1"], **raised) for c in ("forward",)
    ]
    rows += [
        _judged(
            "forward", "fail", "seed", seed_rule, case_id="neg", tp=2, params=params["neg"], symptom=Symptom.NONFINITE
        )
    ]
    rows += [
        _judged("forward", "pass", "seed", seed_rule, case_id=k, tp=t, params=params[k])
        for k, t in (("v1", 1), ("neg", 1), ("big", 1), ("big", 2))
    ]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 2, finding_lines(table)
    assert set(table["status"]) == {"warn", "fail"}, finding_lines(table)  # the crash demoted, the NaN a failure


def test_a_wrong_answer_on_uneven_shards_and_a_seed_nan_on_minus_inf_logits_at_one_tp_are_two_lines():
    """Issue 42: at TP 2 a distillation op is wrong on V = 37 (uneven shards: our rule) and NaN on −inf logits (the
    seed's, "when neg_inf ≥ 0.3"). They show in one check at one topology, but the seed's trigger is an input, not
    the mesh: two roots, the wrong answer an opinion of ours on a line of its own."""
    seed_rule = "the op's documented result (its docstring and signature)"
    uneven = "docs/ops/model_utils.md#uneven-vocab-shards"
    params = {"v37": {"V": 37, "K": 5}, "inf": {"V": 24, "K": 5, "neg_inf": 0.3}, "v24": {"V": 24, "K": 4}}
    rows = [
        _judged("forward:student", "fail", "ours", uneven, case_id="v37", tp=2, params=params["v37"], symptom="values"),
        _judged(
            "forward:student", "fail", "seed", seed_rule, case_id="inf", tp=2, params=params["inf"], symptom="nonfinite"
        ),
    ]
    rows += [
        _judged("forward:student", "pass", "seed", seed_rule, case_id=k, tp=t, params=params[k])
        for k, t in (("v37", 1), ("inf", 1), ("v24", 1), ("v24", 2))
    ]
    table = causes(pd.DataFrame(rows))
    lines = finding_lines(table)
    assert len(table) == 2, lines
    assert any(line.startswith("FAIL model_utils.F: wrong on input only our rule describes") for line in lines), lines
    assert any("non-finite" in line and "when neg_inf ≥ 0.3" in line for line in lines), lines


def test_a_wrong_answer_on_our_input_in_a_check_the_seeds_cases_get_wrong_too_stays_with_the_seeds_line():
    """An averaged gradient is wrong on masked targets and on plain ones alike: the op's one defect, one line, never
    split into an opinion of ours (the masked case's rows) beside it."""
    seed_rule = "the op's documented result (its docstring and signature)"
    wrong = dict(symptom=Symptom.VALUES, message="|err| 0.9 > budget")
    rows = [_judged("grad:logits", "fail", "ours", MASKED, case_id="masked", cp=2, params={"masked": 0.2}, **wrong)]
    rows += [_judged("grad:logits", "fail", "seed", seed_rule, case_id="plain", cp=2, **wrong)]
    rows += [_judged("grad:logits", "pass", "seed", seed_rule, case_id=k, cp=1) for k in ("masked", "plain")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1 and table.iloc[0]["count"] == 2, finding_lines(table)
    assert not table.iloc[0]["kind"].startswith(OURS_RULE_PREFIX)


def test_lines_under_one_rule_of_ours_are_one_line_across_ops_whether_they_answer_wrong_or_raise():
    """Issue 42: ids outside [0, V) answered wrong by one op (a FAIL) and raised on by another (a warn: loud is
    acceptable there) show one opinion of ours on one input: one FAIL line naming both ops, the raise's rows still
    written `warn`.  A raise under another rule of ours, and a wrong answer the seed's rule finds, keep their lines."""
    seed_rule = "the op's documented result (its docstring and signature)"
    top_k = "docs/ops/model_utils.md#top-k--top-p-filtering"
    raised = dict(symptom=Symptom.EXCEPTION, error_type="IndexError", error_where=f"{THEIRS}:52")
    masked = dict(case_id="masked", params={"masked": 0.2})
    rows = [
        _judged("grad:logits", "fail", "ours", MASKED, op="model_utils.A", symptom=Symptom.VALUES, **masked),
        _judged(
            "forward", "error", "ours", MASKED, op="model_utils.B", error_message="index 7 out of bounds", **raised
        ),
        _judged("forward", "error", "ours", top_k, op="model_utils.C", case_id="k0", error_message="size", **raised),
        _judged("forward", "fail", "seed", seed_rule, op="model_utils.D", case_id="ties", symptom=Symptom.VALUES),
    ]
    rows[1].update(masked)
    for op in ("model_utils.A", "model_utils.B", "model_utils.C", "model_utils.D"):
        rows += [_judged(c, "pass", "seed", seed_rule, op=op, case_id="plain") for c in ("forward", "grad:logits")]
    df = pd.DataFrame(rows)
    table = causes(df)
    lines = finding_lines(table)
    assert len(table) == 3, lines
    ours = table[table["rule"].str.contains(MASKED, regex=False)].iloc[0]
    assert ours["ops"] == ("model_utils.A", "model_utils.B") and ours["status"] == "fail", lines
    assert (
        ours["kind"].startswith(OURS_RULE_PREFIX) and "raises on input only our rule feeds: IndexError" in ours["kind"]
    )
    assert table[table["ops"] == ("model_utils.C",)].iloc[0]["status"] == "warn", lines  # another rule of ours
    assert table[table["ops"] == ("model_utils.D",)].iloc[0]["status"] == "fail", lines
    settled = demote(df)
    assert list(settled["status"][:4]) == ["fail", "warn", "warn", "fail"], settled


def test_topk_values_rounded_exactly_to_float32_are_a_precision_finding_a_wrong_value_is_not():
    """distributed_vocab_topk's seed states no dtype for the values: float64 values returned as their exact float32
    roundings are our precision rule's finding (PrecisionOnly), a value off by a float32 ulp a wrong value."""
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.topk(logits, 4, dim=-1).values
    ctx = SimpleNamespace(dtype=torch.float64)
    found = topk_values_exact(expected.float(), expected, {}, {}, ctx)
    assert isinstance(found, PrecisionOnly) and found.symptom == Symptom.PRECISION_FLOAT32, found
    off = expected.float()
    off[1, 2, 3] = torch.nextafter(off[1, 2, 3], torch.tensor(float("inf")))
    ok, message = topk_values_exact(off, expected, {}, {}, ctx)
    assert not ok and "got torch.float32" in message, message
    assert topk_values_exact(expected, expected, {}, {}, ctx) == (True, "values equal torch.topk exactly")


def test_topk_values_in_float32_warn_under_our_precision_rule_and_a_wrong_one_fails(tmp_path):
    args = (
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.distributed_vocab_topk",
        "--case",
        "b4s6v16-ties-k10",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    warned = shardcheck(
        *args, "--impl", f"model_utils={IMPLS / 'topk_values_float32_model_utils.py'}", out=tmp_path / "w", strict=False
    )
    assert warned.returncode == 0, warned.stdout
    assert len(warned.causes) == 1, warned.causes.to_string()
    line = warned.causes.iloc[0]
    assert (line["status"], line["kind"], line["checks"]) == ("warn", "float64 computed in float32", "forward:values")
    assert line["rule"] == "rule: ours, docs/ops/README.md#conventions-shared-by-every-family", line["rule"]
    off = shardcheck(
        *args, "--impl", f"model_utils={BROKEN / 'model_utils' / 'topk_values_float32_off.py'}", out=tmp_path / "f"
    )
    assert off.returncode == 1, off.stdout
    assert len(off.causes) == 1, off.causes.to_string()
    line = off.causes.iloc[0]
    assert (line["status"], line["kind"]) == ("fail", "wrong values") and "rule: seed" in line["rule"], line
    assert "rank 0" in line["worst"] and "forward:values" in line["checks"], line["worst"]
