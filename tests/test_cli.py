"""Bad input: exit 2 and one clear line on stderr, never a traceback.  list and report work."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, cli

from shardcheck.harness.cli import main


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "--op", "model_utils.NoSuchOp"], "unknown op 'model_utils.NoSuchOp'"),
        (["run", "--suite", "nosuite"], "unknown suite 'nosuite'"),
        (["run", "--topology", "dp=1,cp=1,tp=0"], "tp must be positive, got 0"),
        (["run", "--topology", "dp=-2"], "dp must be positive, got -2"),
        (["run", "--topology", "tp=two"], "tp must be an integer"),
        (["run", "--dtype", "float8"], "unknown dtype 'float8'"),
        (["run", "--impl", "model_utils=no.such.module"], "cannot import: ModuleNotFoundError"),
        (["run", "--impl", "model_utils=tests/broken/does_not_exist.py"], "no such file"),
        (["run", "--impl", "nofamily=x"], "unknown family 'nofamily'"),
        (["run", "--impl", "model_utils"], "--impl expects FAMILY=MODULE"),
        (["run", "--world-sizes", "0"], "world sizes must be positive"),
        (["run", "--world-sizes", "a,b"], "expected comma-separated integers"),
        (["run", "--timeout", "0"], "--timeout must be positive"),
        (["run", "--timeout", "-1.5"], "--timeout must be positive, got -1.5"),
        (["run", "--bench", "--bench-iters", "0"], "--bench-iters must be positive, got 0"),
        (["fuzz", "--timeout", "0"], "--timeout must be positive"),
        (["run", "--case", "no-such-case*"], "nothing to run"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (["report", "/nonexistent/dir"], "no results.jsonl"),
        ([], "missing command"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # in-process (fast); an escaping exception would fail the test
    code = main(args + (["--out", str(tmp_path / "run")] if args[:1] == ["run"] else []))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardcheck: error: ")
    assert words in lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--timeout", "0"], "--timeout must be positive, got 0"),
        (["--timeout", "-3"], "--timeout must be positive, got -3"),
        (["--topology", "tp=0"], "tp must be positive, got 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_hand_launched_worker_bad_usage_is_one_line_and_exit_2(args, words, capsys, tmp_path):
    """`python -m shardcheck.harness.standalone` checks its options as `shardcheck run` does (RunSettings), before
    it touches torchrun's environment or process group."""
    from shardcheck.harness import standalone

    code = standalone.main([*args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardcheck worker: error: ") and words in lines[0]


def test_console_script_usage_error_has_no_traceback():
    proc = cli("run", "--topology", "dp=0", fresh=True)  # the process: no traceback reaches the terminal
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shardcheck: error: bad topology 'dp=0': dp must be positive, got 0"


def _usage_error(capsys, *args) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_impl_that_raises_at_import_is_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad_impl.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    err = _usage_error(capsys, "run", "--impl", f"model_utils={bad}", "--out", str(tmp_path / "run"))
    assert "cannot import: RuntimeError: boom at import" in err


def test_impl_lacking_every_selected_op_is_usage_error(capsys, tmp_path):
    path = tmp_path / "log_softmax_only.py"  # the wrong file for this op
    path.write_text(
        "def _compute_distributed_log_softmax(vocab_parallel_logits, group):\n    raise NotImplementedError\n"
    )
    err = _usage_error(
        capsys,
        "run",
        "--impl",
        f"model_utils={path}",
        "--op",
        "model_utils.DistributedLogprob",
        "--out",
        str(tmp_path / "run"),
    )
    assert "module defines none of the 1 selected model_utils op(s) (no 'DistributedLogprob')" in err


def test_impl_lacking_every_op_of_its_family_is_usage_error_with_the_default_selection(capsys, tmp_path):
    """The other families' ops are selected too: the check is per family, so a module that defines nothing of
    kd_loss is the wrong file (exit 2 at planning) rather than a 68 s run ending in signature FAILs."""
    path = tmp_path / "notanimpl.py"
    path.write_text("def helper(x):\n    return x\n")
    err = _usage_error(capsys, "run", "--quick", "--impl", f"kd_loss={path}", "--out", str(tmp_path / "run"))
    assert f"--impl kd_loss={path}: module defines none of the " in err
    assert "selected kd_loss op(s) (no " in err and "is it the right file?" in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("results.jsonl"))


def test_list_names_every_op_and_default_topologies(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for op in (
        "_compute_distributed_log_softmax",
        "_compute_distributed_softmax",
        "DistributedLogprob",
        "ChunkedDistributedLogprob",
        "DistributedCrossEntropy",
        "from_parallel_logits_to_logprobs",
        "all_to_all_vp2sq",
        "all_to_all_sq2vp",
    ):
        assert f"model_utils.{op} " in out
    assert (
        "default topologies: dp1-cp1-tp1 dp2-cp1-tp1 dp1-cp2-tp1 dp1-cp1-tp2 dp4-cp1-tp1 dp2-cp2-tp1 dp1-cp4-tp1 "
        "dp2-cp1-tp2 dp1-cp2-tp2 dp1-cp1-tp4"
    ) in out


def test_out_dir_holding_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text(json.dumps({"status": "pass"}) + "\n")
    assert "already holds a run" in _usage_error(capsys, "run", "--out", str(tmp_path))


def test_report_of_a_run_without_rows_is_one_line_and_exit_2(capsys, tmp_path):
    (tmp_path / "results.jsonl").write_text("\n")
    (tmp_path / "run.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardcheck: error: {tmp_path}: results.jsonl holds no result rows (the run recorded no check)"]


def test_report_of_rows_lacking_what_the_pages_read_is_one_line_and_exit_2(capsys, tmp_path):
    row = {"run_id": "r", "op": "model_utils.DistributedLogprob", "case_id": "c", "dp": 1, "cp": 1, "tp": 2}
    row |= {"dtype": "float32", "check": "forward", "status": "fail", "err_ratio": 3.0}  # made by hand: no message
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"shardcheck: error: {tmp_path}: results.jsonl rows lack message (rows `shardcheck run` did not write)"
    ]
    (tmp_path / "results.jsonl").write_text(json.dumps(row | {"message": "off by one"}) + "\n")
    assert main(["report", str(tmp_path)]) == 0 and (tmp_path / "report.html").is_file()


def test_list_says_which_cases_run_expert_parallel_or_hsdp_topologies(capsys):
    train_step = ROOT / "tests" / "model_cases" / "train_step" / "train_step.py"
    assert main(["list", "--suite-path", str(train_step)]) == 0
    out = capsys.readouterr().out
    assert "  moe.parallelize  (1 case; 1 expert-parallel)\n" in out
    assert "  train_step.parallelize_hsdp  (1 case; 1 HSDP)\n" in out
    assert "  train_step.parallelize  (2 cases)\n" in out  # neither: no mark
    assert "expert-parallel topologies (cases that run ep): dp2-ep2-cp1-tp1 dp4-ep2-cp1-tp1 dp4-ep4-cp1-tp1" in out
    assert "HSDP topologies (cases that run HSDP): given with --topology, e.g. dp=4,dp_replicate=2" in out
