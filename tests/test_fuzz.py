"""`shardcheck fuzz`: broken implementations the fixed matrix passes are found and shrunk, the search is
deterministic for a seed, our implementation survives a small budget, the corpus is replayed first by
`shardcheck run`, a suite without a space is skipped, bad usage is exit 2, and a hanging example ends.

Each example is one item on real ranks: the budgets here are small and the runs shared between assertions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import BROKEN, FIXTURES, cli, shardcheck

SMALL = ("--world-sizes", "1,2", "--seed", "0")

# Four broken implementations whose bug the fixed matrix misses: {op: (family, file, the failure's check, the check
# on its shrunk params)}.  Each shrunk case is the smallest that shows the bug along its space's own order.
MISSED = {
    # the top-k chunk loop stops one position early: a last chunk of one position is lost
    "model_utils.distributed_vocab_topk": (
        "model_utils",
        BROKEN / "model_utils" / "topk_chunk_tail.py",
        "forward:ids",
        lambda p: (p["B"], p["S"], p["V"], p["k"], p["topology"]) == (1, 1, 1, 1, [1, 1, 1]),
    ),
    # chunk_size 0 squeezes the token dim: one valid token on a rank becomes a [V] vector
    "kd_loss.KDLoss": (
        "kd_loss",
        BROKEN / "kd_loss" / "unchunked_squeeze.py",
        "forward",
        lambda p: (
            p["chunk_size"] == 0
            and p["valid_per_row"] == [1]
            and (p["B"], p["S"], p["V"], p["topology"]) == (1, 1, 1, [1, 1, 1])
        ),
    ),
    # the loss count taken as this rank's count times DP: wrong as soon as the losses split unevenly
    "distributed_utils.reduce_loss": (
        "distributed_utils",
        BROKEN / "distributed_utils" / "loss_count_assumes_equal_ranks.py",
        "forward:denominator",
        lambda p: (
            p
            == {
                "topology": [2, 1, 1],
                "dtype": "float64",
                "per_token_loss": False,
                "dp_group": True,
                "n_losses": 3,
                "n_token_slices": 1,
                "tokens_over_int32": False,
            }
        ),
    ),
    # max_seqlen of the first chunk only: wrong when a later chunk holds the longest sequence
    "cp_utils.make_cp_batch_for_te": (
        "cp_utils",
        BROKEN / "cp_utils" / "max_seqlen_of_first_chunk.py",
        "property:max_seqlen",
        lambda p: (
            p
            == {
                "topology": [1, 1, 1],
                "dtype": "float64",
                "lens": [[[1, 2]], [[1, 4]]],
                "S": 4,
                "padding_token_id": 0,
                "num_chunks": 2,
                "position_ids": False,
                "embeds": 0,
            }
        ),
    ),
}
SELECT = [arg for op, (family, path, _, _) in MISSED.items() for arg in ("--op", op, "--impl", f"{family}={path}")]


def _fuzz(tmp: Path, name: str, *args: str, timeout: float = 900):
    run = shardcheck("fuzz", *args, "--corpus", str(tmp / "corpus"), out=tmp / name, timeout=timeout)
    summary = json.loads((tmp / name / "fuzz.json").read_text()) if (tmp / name / "fuzz.json").exists() else None
    return run, summary


@pytest.fixture(scope="module")
def missed(tmp_path_factory):
    """One fuzz run of the four broken implementations (one session: every example on the same ranks)."""
    tmp = tmp_path_factory.mktemp("missed")
    run, summary = _fuzz(tmp, "fuzz", *SELECT, "--examples", "100", "--timeout", "20", *SMALL)
    return tmp, run, {op["op"]: op for op in summary["ops"]}


def test_the_fixed_matrix_misses_all_four(tmp_path):
    run = shardcheck("run", *SELECT, "--dtype", "float64", "--corpus", str(tmp_path / "none"), out=tmp_path / "run")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = run.rows
    assert set(rows["op"]) == set(MISSED) and (rows["status"] == "pass").all() and len(rows) > 1000


@pytest.mark.parametrize("op", list(MISSED))
def test_fuzz_finds_and_shrinks_it(missed, op):
    tmp, run, ops = missed
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    _, _, check, smallest = MISSED[op]
    found = ops[op]
    assert found["verdict"] == "fail" and found["failure"]["signature"][0] == check
    assert found["examples"] <= 100  # a bounded search, shrinking included
    assert smallest(found["failure"]["params"]), found["failure"]["params"]
    saved = [json.loads(f.read_text()) for f in (tmp / "corpus").glob(f"{op}--*.json")]
    assert [entry["params"] for entry in saved] == [found["failure"]["params"]]
    assert f"FAIL {op}: " in run.stdout


def test_the_report_and_rerun_lines_of_the_shrunk_cases(missed):
    tmp, run, _ = missed
    assert (tmp / "fuzz" / "report.html").is_file()
    for op in MISSED:
        assert "rerun: shardcheck run --suite " in run.stdout and f"--op {op} --case fuzz-" in run.stdout
    assert run.stdout.count("--corpus") >= len(MISSED)


def test_run_replays_the_corpus_first(missed):
    tmp, _, ops = missed
    op = "distributed_utils.reduce_loss"
    family, path, check, _ = MISSED[op]
    corpus = ["--corpus", str(tmp / "corpus")]
    broken = shardcheck(
        "run",
        "--op",
        op,
        "--impl",
        f"{family}={path}",
        "--dtype",
        "float64",
        "--world-sizes",
        "2",
        *corpus,
        out=tmp / "replay-broken",
    )
    assert broken.returncode == 1
    rows = broken.rows
    first = rows.iloc[0]["case_id"]
    assert first.startswith("fuzz-")  # the saved failure runs first
    failed = broken.failed()
    assert set(failed["case_id"]) == {first} and set(failed["check"]) == {check}
    rerun = failed.iloc[0]["rerun"]
    assert "--corpus" in rerun and f"--case {first}" in rerun
    ours = shardcheck(
        "run",
        "--op",
        op,
        "--case",
        "fuzz-*",
        "--dtype",
        "float64",
        "--world-sizes",
        "2",
        *corpus,
        out=tmp / "replay-ours",
    )
    assert ours.returncode == 0 and len(ours.rows) > 0, ours.stdout[-2000:]
    listed = cli("list", *corpus)
    assert "fuzz corpus" in listed.stdout and f"{len(MISSED)} saved case" in listed.stdout


def test_fuzz_is_deterministic_for_a_seed(missed, tmp_path):
    _, _, ops = missed
    op = "distributed_utils.reduce_loss"
    family, path, _, _ = MISSED[op]
    _, again = _fuzz(tmp_path, "again", "--op", op, "--impl", f"{family}={path}", "--examples", "100", *SMALL)
    (found,) = again["ops"]
    assert found["failure"] == ops[op]["failure"] and found["first"] == ops[op]["first"]
    assert found["examples"] == ops[op]["examples"]


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


@pytest.mark.parametrize(
    "args, words",
    [
        (("--examples", "0"), "--examples must be positive"),
        (("--time", "-1"), "--time must be positive"),
        (("--op", "model_utils.nope"), "unknown op"),
        (("--topology", "dp=x"), "bad topology"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(tmp_path, args, words):
    result = cli("fuzz", *args, "--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "corpus"))
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


def test_a_corrupt_corpus_file_is_exit_2_with_its_path(tmp_path):
    (tmp_path / "corpus").mkdir()
    bad = tmp_path / "corpus" / "broken.json"
    bad.write_text('{"suite": "kd_loss"')
    for command in ("fuzz", "run"):
        result = cli(
            command, "--op", "kd_loss.KDLoss", "--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / command)
        )
        assert result.returncode == 2 and str(bad) in result.stderr and "Traceback" not in result.stderr


def test_a_hanging_example_ends(tmp_path):
    """A rank blocked in a collective its peer skipped: the example ends at --timeout like a `run` item (the peer is
    named, the ranks relaunched), the search goes on within --time, and the shrunk case is reported."""
    started = time.time()
    run, summary = _fuzz(
        tmp_path,
        "fuzz",
        "--op",
        "model_utils.DistributedLogprob",
        "--impl",
        f"model_utils={FIXTURES / 'model_utils' / 'skips_collective.py'}",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--timeout",
        "5",
        "--time",
        "30",
        timeout=400,
    )
    assert run.returncode == 1, run.stdout[-3000:]
    assert time.time() - started < 300
    op = summary["ops"][0]
    assert op["failure"]["signature"][1] == "error"
    rows = run.rows
    assert rows["message"].str.contains("did not finish the case within 5s").any(), rows["message"].tolist()
