"""What the ranks' fork server imports for a run: Megatron-Core once, when the Megatron cases are selected."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardcheck.harness.cli import MEGATRON_PRELOAD, _selects_megatron
from shardcheck.harness.cli_parser import make_parser
from shardcheck.harness.driver import pool


@pytest.mark.parametrize(
    "argv, selected",
    [
        (["run"], True),  # the default run: every suite
        (["run", "--world-sizes", "1,2"], True),
        (["run", "--suite", "kd_loss,model_utils_megatron"], True),
        (["run", "--suite", "kd_loss"], False),  # a rerun of another suite does not pay the import
        (["run", "--op", "model_utils.DistributedLogprob"], False),
    ],
)
def test_megatron_is_preloaded_for_the_runs_that_select_its_cases(argv, selected):
    assert _selects_megatron(make_parser().parse_args(argv)) is selected


def test_preloaded_modules_are_added_once(monkeypatch):
    monkeypatch.setattr(pool, "RANK_PRELOAD", list(pool.RANK_PRELOAD))
    pool.preload_in_ranks([MEGATRON_PRELOAD])
    pool.preload_in_ranks([MEGATRON_PRELOAD])
    assert pool.RANK_PRELOAD == ["shardcheck.harness.rank.preload", MEGATRON_PRELOAD]


def test_the_megatron_preload_imports_it_without_a_word_on_stderr():
    pytest.importorskip("megatron.core")
    code = f"import sys, {MEGATRON_PRELOAD}; print('megatron.core.models.gpt.gpt_model' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert done.stderr == "", done.stderr  # Megatron's import-time warnings would print in the driver's output
