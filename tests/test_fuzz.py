"""`shardcheck fuzz`: broken implementations the fixed matrix passes are found and shrunk, the search is
deterministic for a seed, our implementation survives a small budget, the corpus is replayed first by
`shardcheck run`, a suite without a space is skipped, bad usage is exit 2, and a hanging example ends.

Each example is one item on real ranks: the budgets here are small and the runs shared between assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import BROKEN, FIXTURES, cli, shardcheck

TOPK_TAIL = BROKEN / "model_utils" / "topk_chunk_tail.py"
KD_SQUEEZE = BROKEN / "kd_loss" / "unchunked_squeeze.py"
SMALL = ("--world-sizes", "1,2", "--seed", "0")


def _fuzz(tmp: Path, name: str, *args: str, timeout: float = 1500):
    run = shardcheck("fuzz", *args, "--corpus", str(tmp / "corpus"), out=tmp / name, timeout=timeout)
    summary = json.loads((tmp / name / "fuzz.json").read_text()) if (tmp / name / "fuzz.json").exists() else None
    return run, summary


@pytest.fixture(scope="module")
def topk_tail(tmp_path_factory):
    """One fuzz run of the top-k chunk-tail bug, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("topk")
    run, summary = _fuzz(tmp, "fuzz", "--op", "model_utils.distributed_vocab_topk",
                         "--impl", f"model_utils={TOPK_TAIL}", "--examples", "40", *SMALL)
    return tmp, run, summary


def test_matrix_misses_the_topk_chunk_tail(tmp_path):
    run = shardcheck("run", "--suite", "model_utils", "--op", "model_utils.distributed_vocab_topk",
                     "--impl", f"model_utils={TOPK_TAIL}", "--dtype", "float64", "--corpus", str(tmp_path / "none"),
                     out=tmp_path / "run")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_fuzz_finds_and_shrinks_the_topk_chunk_tail(topk_tail):
    tmp, run, summary = topk_tail
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    (op,) = summary["ops"]
    shrunk = op["failure"]["params"]
    step = shrunk["chunk_size"] or shrunk["S"]
    assert shrunk["S"] % step == 1 or step == 1  # the last chunk holds one position: the bug's condition
    # nothing larger than needed: one row, one id, one rank
    assert (shrunk["B"], shrunk["V"], shrunk["k"], shrunk["topology"]) == (1, 1, 1, [1, 1, 1])
    assert shrunk["S"] <= 2
    assert f"FAIL model_utils.distributed_vocab_topk" in run.stdout and "shrunk from" in run.stdout
    assert "rerun: shardcheck run --suite model_utils --op model_utils.distributed_vocab_topk --case fuzz-" \
           in run.stdout and "--corpus" in run.stdout
    assert (tmp / "fuzz" / "report.html").is_file()
    saved = list((tmp / "corpus").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["params"] == shrunk


def test_run_replays_the_corpus_first(topk_tail):
    tmp, _, summary = topk_tail
    corpus = ["--corpus", str(tmp / "corpus")]
    broken = shardcheck("run", "--suite", "model_utils", "--op", "model_utils.distributed_vocab_topk",
                        "--impl", f"model_utils={TOPK_TAIL}", "--dtype", "float64", "--world-sizes", "1", *corpus,
                        out=tmp / "replay-broken")
    assert broken.returncode == 1
    rows = broken.rows
    assert rows.iloc[0]["case_id"].startswith("fuzz-")  # the saved failure runs first
    failed = broken.failed()
    assert set(failed["case_id"]) == {rows.iloc[0]["case_id"]}
    rerun = failed.iloc[0]["rerun"]
    assert "--corpus" in rerun and f"--case {rows.iloc[0]['case_id']}" in rerun
    ours = shardcheck("run", "--suite", "model_utils", "--op", "model_utils.distributed_vocab_topk",
                      "--case", "fuzz-*", "--dtype", "float64", "--world-sizes", "1", *corpus, out=tmp / "replay-ours")
    assert ours.returncode == 0 and len(ours.rows) > 0, ours.stdout[-2000:]
    listed = cli("list", *corpus)
    assert "fuzz corpus" in listed.stdout and "1 saved case " in listed.stdout


def test_fuzz_is_deterministic_for_a_seed(topk_tail, tmp_path):
    _, _, first = topk_tail
    _, again = _fuzz(tmp_path, "again", "--op", "model_utils.distributed_vocab_topk",
                     "--impl", f"model_utils={TOPK_TAIL}", "--examples", "40", *SMALL)
    assert again["ops"][0]["failure"] == first["ops"][0]["failure"]
    assert again["ops"][0]["examples"] == first["ops"][0]["examples"]


def test_fuzz_finds_and_shrinks_the_kd_loss_squeeze(tmp_path):
    matrix = shardcheck("run", "--suite", "kd_loss", "--op", "kd_loss.KDLoss", "--impl", f"kd_loss={KD_SQUEEZE}",
                        "--dtype", "float64", "--corpus", str(tmp_path / "none"), out=tmp_path / "run")
    assert matrix.returncode == 0, matrix.stdout[-2000:]
    run, summary = _fuzz(tmp_path, "fuzz", "--op", "kd_loss.KDLoss", "--impl", f"kd_loss={KD_SQUEEZE}",
                         "--examples", "40", *SMALL)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    shrunk = summary["ops"][0]["failure"]["params"]
    assert shrunk["chunk_size"] == 0 and sum(shrunk["valid_per_row"]) == 1  # one valid token, one chunk
    assert (shrunk["B"], shrunk["S"], shrunk["V"], shrunk["topology"]) == (1, 1, 1, [1, 1, 1])


def test_our_kd_loss_survives_a_small_budget(tmp_path):
    run, summary = _fuzz(tmp_path, "fuzz", "--op", "kd_loss.KDLoss", "--examples", "6", *SMALL)
    assert run.returncode == 0, run.stdout[-3000:]
    assert summary["ops"][0]["verdict"] == "pass" and summary["ops"][0]["examples"] == 6


def test_a_suite_without_a_space_is_skipped(tmp_path):
    suite = tmp_path / "no_space_suite.py"
    suite.write_text((FIXTURES.parent.parent / "docs" / "writing-a-suite" / "my_ops_suite.py").read_text())
    (tmp_path / "my_ops.py").write_text((FIXTURES.parent.parent / "docs" / "writing-a-suite" / "my_ops.py").read_text())
    run, _ = _fuzz(tmp_path, "fuzz", "--suite-path", str(suite), "--suite", "no_space_suite", "--examples", "1")
    assert run.returncode == 2
    assert "skip no_space_suite: the suite declares no fuzz space" in run.stdout
    assert "nothing to fuzz" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("args, words", [
    (("--examples", "0"), "--examples must be positive"),
    (("--time", "-1"), "--time must be positive"),
    (("--op", "model_utils.nope"), "unknown op"),
    (("--topology", "dp=x"), "bad topology"),
])
def test_bad_usage_is_one_line_and_exit_2(tmp_path, args, words):
    result = cli("fuzz", *args, "--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "corpus"))
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


def test_a_corrupt_corpus_file_is_exit_2_with_its_path(tmp_path):
    (tmp_path / "corpus").mkdir()
    bad = tmp_path / "corpus" / "broken.json"
    bad.write_text('{"suite": "kd_loss"')
    for command in ("fuzz", "run"):
        result = cli(command, "--op", "kd_loss.KDLoss", "--corpus", str(tmp_path / "corpus"),
                     "--out", str(tmp_path / command))
        assert result.returncode == 2 and str(bad) in result.stderr and "Traceback" not in result.stderr


def test_a_hanging_example_ends(tmp_path):
    run, summary = _fuzz(tmp_path, "fuzz", "--op", "model_utils.DistributedLogprob",
                         "--impl", f"model_utils={FIXTURES / 'model_utils' / 'skips_collective.py'}",
                         "--topology", "dp=1,cp=1,tp=2", "--timeout", "5", "--time", "60", timeout=400)
    assert run.returncode == 1, run.stdout[-3000:]
    op = summary["ops"][0]
    assert op["failure"]["signature"][1] == "error"
    assert "hung" in op["failure"]["signature"][2] or op["failure"]["signature"][2] == "blocked"
