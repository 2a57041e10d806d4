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


def _pair(tmp_path, args, family: str, pre, fixed):
    """The runs of the pre-fix module and of the fixed one (None: our own implementation) on one selection."""
    return [
        shardcheck(*args, *(("--impl", f"{family}={module}") if module else ()), out=tmp_path / name)
        for name, module in (("pre", pre), ("fixed", fixed))
    ]


def test_the_pre_fix_copy_prints_its_bug_as_a_line_the_fixed_one_does_not(tmp_path):
    cp = BROKEN / "cp_utils"
    pre, fixed = _pair(
        tmp_path, ARGS, "cp_utils", cp / "thd_prefix_mask_by_token_id.py", cp / "thd_fixed_requires_position_ids.py"
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


def test_a_pre_fix_copy_wrong_in_every_dtype_is_one_line_its_float32_fix_does_not_print(tmp_path):
    """Issue 42, item 1: the pre-fix log-softmax is wrong at TP 2 in every dtype and returns float32 for float64; its
    float64 rows are on its one "wrong values" line (not a "wrong dtype" line of their own, which its fixed version,
    still computing in float32, would seem to share).  The fixed version prints only the precision warning."""
    args = (
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
    )
    mu = BROKEN / "model_utils"
    pre, fixed = _pair(
        tmp_path, args, "model_utils", mu / "float32_log_softmax_no_sum.py", mu / "float32_log_softmax_fixed.py"
    )
    assert pre.returncode == 1 and fixed.returncode == 1, pre.stdout + fixed.stdout  # --strict: the warning fails
    before, after = _lines(pre), _lines(fixed)
    assert before == {"fail model_utils._compute_distributed_log_softmax: wrong values"}, before
    assert after == {"warn model_utils._compute_distributed_log_softmax: float64 computed in float32"}, after


def test_a_pre_fix_gradient_reduced_twice_is_a_line_of_its_own_beside_another_wrong_gradient(tmp_path):
    """Issue 42, the pre-fix copies: an upstream distillation loss whose per-token loss went through an autograd
    all-reduce (the student's gradient ×TP) also had a teacher gradient wrong at TP ≥ 2, which its fix kept.  Both
    fail in the same items under the same condition and rule, so they were one "wrong values" line in both versions
    and the fix changed nothing a user could diff.  Values exactly a mesh size times the right ones are a root of
    their own ("wrong values, a mesh size times the right ones"): the pre-fix copy prints it, the fixed one does not."""
    args = (
        "run",
        "--suite",
        "kd_loss",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "group-b4s6v37-T1-nbltensor-chunk0-masked-tgrad",
        "--topology",
        "dp=1,cp=1,tp=1",  # where tp is 1 the student's gradient is right: the ×2 at tp 2 is the mesh size's
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    kd = BROKEN / "kd_loss"
    pre, fixed = _pair(
        tmp_path, args, "kd_loss", kd / "student_grad_reduced_twice.py", kd / "teacher_grad_off_at_tp.py"
    )
    assert pre.returncode == 1 and fixed.returncode == 1, pre.stdout + fixed.stdout
    before, after = _lines(pre), _lines(fixed)
    teacher = "fail kd_loss.KDLoss: wrong values"
    assert after == {teacher}, after
    assert before == {teacher, "fail kd_loss.KDLoss: wrong values, a mesh size times the right ones"}, before
    scaled = pre.causes[pre.causes["kind"].str.contains("mesh size")].iloc[0]
    assert scaled["checks"] == "grad:student_logits" and "rule: seed" in scaled["rule"], scaled
    assert "expected" in scaled["worst"] and "rank" in scaled["worst"], scaled["worst"]
    assert pre.causes[pre.causes["kind"] == "wrong values"].iloc[0]["checks"] == "grad:teacher_logits"


def test_a_pre_fix_loss_without_its_temperature_factor_is_a_line_of_its_own(tmp_path):
    """Issue 42, the pre-fix copies: the first upstream distillation loss had no T² factor (its loss and gradients
    exactly 1/T² of the right ones at T != 1); its fixed copy kept another wrong gradient.  Both printed one "wrong
    values" line.  Values exactly a power of a case parameter times the right ones, where the check passes at that
    parameter's 1, are a root of their own ("wrong values, 1/temperature² times the right ones")."""
    args = (
        "run",
        "--suite",
        "kd_loss",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "group-b4s6v37-T[12]-nbltensor-chunk[04]-masked-tgrad",  # T = 1 shows the loss right, T = 2 its factor
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    kd = BROKEN / "kd_loss"
    pre, fixed = _pair(
        tmp_path, args, "kd_loss", kd / "no_t2_teacher_grad_off_at_tp.py", kd / "teacher_grad_off_at_tp.py"
    )
    assert pre.returncode == 1 and fixed.returncode == 1, pre.stdout + fixed.stdout
    before, after = _lines(pre), _lines(fixed)
    teacher = "fail kd_loss.KDLoss: wrong values"
    assert after == {teacher}, after
    assert before == {teacher, "fail kd_loss.KDLoss: wrong values, 1/temperature² times the right ones"}, before
    scaled = pre.causes[pre.causes["kind"].str.contains("temperature")].iloc[0]
    assert "grad:student_logits" in scaled["checks"] and "forward" in scaled["checks"], scaled
    assert "rule: seed" in scaled["rule"] and "T2" in scaled["worst"], scaled["worst"]


def test_a_pre_fix_quit_on_rank_0_is_a_line_its_logged_exit_does_not_print(tmp_path):
    """Issue 42, the pre-fix copies (distributed_utils): upstream's FirstRankPerNode ended rank 0 with `quit(1)` when
    its block raised, losing the exception; its fix logs it first, then raises SystemExit(1) from it.  Both end the
    rank with a bare SystemExit, so the fixed version was judged as losing the error too and the two printed the same
    lines.  A rank that logged the block's exception names it: only the pre-fix copy prints the error_names_rank
    line."""
    args = (
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils.FirstRankPerNode",
        "--case",
        "raises-on-rank-0",
        "--topology",
        "dp=1,cp=1,tp=1",
    )
    broken = BROKEN / "distributed_utils"
    pre, fixed = _pair(
        tmp_path,
        args,
        "distributed_utils",
        broken / "quit_when_rank0_raises.py",
        broken / "exit_logged_when_rank0_raises.py",
    )
    assert pre.returncode == 1, pre.stdout  # a warn under a rule of ours: --strict
    before, after = _lines(pre), _lines(fixed)
    lost = "warn distributed_utils.FirstRankPerNode: property:error_names_rank does not hold"
    assert before - after == {lost}, (before, after)
    line = pre.causes[pre.causes["kind"].str.contains("error_names_rank")].iloc[0]
    assert "SystemExit: 1, nothing logged (expected rank 0's RuntimeError)" in line["worst"], line["worst"]
    named = fixed.rows[fixed.rows["check"] == "property:error_names_rank"]
    assert len(named) and (named["status"] == "pass").all(), named


def test_a_pre_fix_group_bootstrap_raise_is_a_line_per_message_not_folded_into_properties(tmp_path):
    """Issue 42, the pre-fix copies (distributed_utils): an early FirstRankPerNode bootstrapped a process group it
    could not create, raising on every rank of a job without a group and in a single process, where its fix made the
    single process a plain block and created the job's group.  The properties those raises made fail were one line
    with the copies' shared defect.  A rank's own exception where the case raises nothing is the case's error, at the
    rank's line in the module under test: a line per message, which the fixed version (here ours) does not print."""
    args = (
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils.FirstRankPerNode",
        "--case",
        "2-nodes-of-2",
        "--case",
        "no-distributed",
        "--topology",
        "dp=1,cp=1,tp=1",
    )
    pre, fixed = _pair(
        tmp_path, args, "distributed_utils", BROKEN / "distributed_utils" / "group_bootstrap_raises.py", None
    )
    assert pre.returncode == 1 and fixed.returncode == 0, pre.stdout + fixed.stdout
    assert _lines(pre) == {
        "error distributed_utils.FirstRankPerNode: ValueError: Default process group has not been initialized, please "
        "make sure to call init_process_group. [fresh rank N of N]",
        "error distributed_utils.FirstRankPerNode: ValueError: Error initializing torch.distributed using env:// "
        "rendezvous: environment variable MASTER_ADDR expected, but not set [fresh rank N of N]",
    }, _lines(pre)
    where = {row.case_id: row.error_where for row in pre.rows.itertuples()}
    assert where["2-nodes-of-2"].endswith("group_bootstrap_raises.py:24"), where
    assert where["no-distributed"].endswith("group_bootstrap_raises.py:26"), where
    assert _lines(fixed) == set()


def test_a_pre_fix_barrier_ignoring_its_group_fails_the_sub_group_case_its_fix_passes(tmp_path):
    """Issue 42, the pre-fix copies (distributed_utils): upstream _barrier_with_timeout barriered a new gloo group over
    all ranks whatever `group` it was given, so a group's members calling it alone hung; its fix barriers on `group`.
    No case called it with a group of some ranks: the two copies printed the same lines.  The sub-group case
    (group-of-2-in-3) fails a barrier that ignores its group (ours: the world's barrier, False after the timeout
    where upstream's hung) and passes ours."""
    args = (
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils._barrier_with_timeout",
        "--case",
        "group-of-2-in-3",
        "--topology",
        "dp=1,cp=1,tp=1",
    )
    pre, fixed = _pair(
        tmp_path, args, "distributed_utils", BROKEN / "distributed_utils" / "barrier_ignores_group.py", None
    )
    assert pre.returncode == 1 and fixed.returncode == 0, pre.stdout + fixed.stdout
    group = "fail distributed_utils._barrier_with_timeout: property:group_members_true does not hold"
    assert _lines(pre) == {group} and _lines(fixed) == set(), (_lines(pre), _lines(fixed))
    line = pre.causes.iloc[0]
    assert "rank 0: False" in line["worst"] and "rank 1: False" in line["worst"], line["worst"]


def test_a_pre_fix_sync_context_that_knows_only_ddp_warns_on_a_wrapper_with_no_sync(tmp_path):
    """Issue 42, the pre-fix copies (distributed_utils): upstream get_sync_ctx gave `no_sync()` to a DDP instance only,
    so a wrapper that has one and is no DDP (Megatron-FSDP's) synced its gradients on every micro-batch; its fix
    (NVIDIA-NeMo/Automodel 147726c) calls any wrapper's `no_sync()`.  The seed names no wrapper: the case
    no-sync-wrapper is judged under our rule, a warning only the pre-fix copy prints (the values stay right)."""
    args = (
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils.get_sync_ctx",
        "--case",
        "no-sync-wrapper-3-micro-batches",
        "--case",
        "ddp-3-micro-batches",
        "--topology",
        "dp=2,cp=1,tp=1",
    )
    pre, fixed = _pair(
        tmp_path, args, "distributed_utils", BROKEN / "distributed_utils" / "no_sync_only_on_ddp.py", None
    )
    assert pre.returncode == 1 and fixed.returncode == 0, pre.stdout + fixed.stdout
    synced = "warn distributed_utils.get_sync_ctx: property:no_grad_sync_before_optim_step does not hold"
    assert _lines(pre) == {synced} and _lines(fixed) == set(), (_lines(pre), _lines(fixed))
    line = pre.causes.iloc[0]
    assert "no-sync-wrapper" in line["worst"] and "micro-batch 1: {'all_reduce@dp'" in line["worst"], line["worst"]
    assert line["rule"].startswith("rule: ours, docs/ops/distributed_utils.md#no-sync-wrapper"), line["rule"]
    values = pre.rows[pre.rows["check"].str.startswith(("forward", "grad:"))]
    assert len(values) and (values["status"] == "pass").all(), values


def test_a_pre_fix_copy_that_does_not_pad_warns_under_our_rule_not_the_seeds(tmp_path):
    """Issue 42, the pre-fix copies (cp_utils): before make_cp_batch_and_ctx padded a sequence 2·CP does not divide,
    torch's context_parallel sharded it in contiguous chunks with load balancing off (attention exact), and loss_mask
    stayed the caller's.  Its layout rows failed citing the seed's "accordingly sharded" for what our rules choose (the
    padding, loss_mask in the batch): an opinion labelled as the seed's.  They warn now, under our rule."""
    run = shardcheck(
        "run",
        "--suite",
        "cp_utils",
        "--op",
        "cp_utils.make_cp_batch_and_ctx",
        "--case",
        "layout-b2s10-pad-masks",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--impl",
        f"cp_utils={BROKEN / 'cp_utils' / 'unpadded_contiguous.py'}",
        out=tmp_path / "p",
    )
    assert run.returncode == 1, run.stdout  # --strict: a warning
    bad = run.rows[run.rows["status"] != "pass"]
    assert set(bad["status"]) == {"warn"} and set(bad["rule_source"]) == {"ours"}, bad[["check", "status"]]
    assert {"property:inside:input_ids", "property:inside:loss_mask"} <= set(bad["check"])
    ids = bad[bad["check"] == "property:inside:input_ids"].iloc[0]["message"]
    assert "torch's contiguous chunk of the unpadded sequence" in ids, ids
    assert [line.split(":")[0] for line in _lines(run)] == ["warn cp_utils.make_cp_batch_and_ctx"], _lines(run)


def test_a_cp_gradient_cut_at_the_local_length_in_an_older_gpu_module_is_a_line_its_fix_does_not_print(tmp_path):
    """Issue 42, the pre-fix copies: NeMo-RL's model_utils before a fix (anubhutivyas/RL 4f316ae, fixed in 0dfa998)
    zeroed the CP all-gather's gradient past this rank's local length, so at cp ≥ 2 the tail chunks got none.  Both
    copies name the TP group `group`, lack chunk_size and sampling_params, and read a pinned index tensor through
    `.cuda()` in that backward: the calls by the seed's names raised TypeError and the backward raised on a CPU
    machine, so both printed the same signature line and nothing else.  Called as a caller leaving those at their
    defaults does, the GPU-only calls kept on the CPU (shims/cuda_calls.py) and the signature line kept apart from
    the values, the pre-fix copy prints the zeroed gradient as a line of its own."""
    args = (
        "run",
        "--suite",
        "model_utils_cp",
        "--op",
        "model_utils.from_parallel_logits_to_logprobs",
        "--case",
        "cp-b2s16v33-target13-nofilter-chunkNone-scale300.0",
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
    )
    cp = BROKEN / "model_utils_cp"
    pre, fixed = _pair(
        tmp_path, args, "model_utils", cp / "gather_grad_cut_at_local_length.py", cp / "gather_grad_whole.py"
    )
    assert pre.returncode == 1 and fixed.returncode == 1, pre.stdout + fixed.stdout  # the older signature fails
    before, after = _lines(pre), _lines(fixed)
    assert len(after) == 1 and next(iter(after)).startswith(
        "fail model_utils.from_parallel_logits_to_logprobs: signature: parameter tp_group renamed group"
    ), after
    assert before - after == {"fail model_utils.from_parallel_logits_to_logprobs: wrong values"}, before
    cut = pre.causes[pre.causes["kind"] == "wrong values"].iloc[0]
    assert cut["checks"] == "grad:logits" and cut["condition"] == "exactly in grad:logits, at cp ≥ 2", cut
    assert "rule: seed" in cut["rule"] and ", got 0;" in cut["worst"] and "rank" in cut["worst"], cut["worst"]


def test_a_top_k_gather_raising_on_int32_ids_warns_under_our_rule_and_its_long_fix_prints_nothing(tmp_path):
    """Issue 42, the pre-fix copies: NeMo-RL's ChunkedDistributedGatherLogprob took `.long()` of its local ids later
    (operagxoksana/RL 708e114 → ARC-Mission/RL 6ec62f4): int32 top-k ids, as an inference engine returns them, raised
    in an op that took int64 indices only.  The seed states no index dtype, so only our rule feeds int32 ids: the raise
    is a warning labelled ours, a line of its own the fixed version does not print.  (Upstream the op was torch.gather,
    which accepts int32 since torch 2.8; these modules use one_hot, which still does not.)  Without the int32 case
    neither version prints anything."""
    args = (
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.ChunkedDistributedGatherLogprob",
        "--case",
        "b2s8v48-k6-dup-chunk3",  # int64 ids under the seed's rules: the raise is the input's, not the op's
        "--case",
        "b2s4v24-ids_int32-k3-dup-chunk3",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    broken = BROKEN / "model_utils"
    pre, fixed = _pair(
        tmp_path, args, "model_utils", broken / "topk_gather_int32_kept.py", broken / "topk_gather_int32_long.py"
    )
    assert pre.returncode == 1 and fixed.returncode == 0, pre.stdout + fixed.stdout  # --strict: the warning fails
    assert _lines(pre) == {
        "warn model_utils.ChunkedDistributedGatherLogprob: raises on input only our rule feeds: RuntimeError: one_hot "
        "is only applicable to index tensor of type LongTensor."
    }, _lines(pre)
    assert _lines(fixed) == set()
    line = pre.causes.iloc[0]
    assert line["rule"] == "rule: ours, docs/ops/model_utils.md#index-dtype", line["rule"]
    assert "ids_int32" in line["condition"] and "[b2s4v24-ids_int32-k3-dup-chunk3]" in line["worst"], line
