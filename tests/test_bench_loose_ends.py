"""The loose ends of --bench, --profile and the run header: a bench sweep naming no parameter is bad usage (one line,
exit 2), --profile merges the launch threads' profiles, the header says whether a shim was used or only installed,
and run.json's machine makes compare and dashboard judge only memory and collectives across machines."""

from __future__ import annotations

from helpers import FIXTURES, cli

BAD_SWEEP = f'''
import dataclasses, sys
sys.path.insert(0, {str(FIXTURES / "memory")!r})
import dtensor_memory as base

FAMILY = base.FAMILY
IMPLEMENTATION = {str(FIXTURES / "memory" / "_dtensor_memory_ops.py")!r}


def cases(quick):
    return base.cases(quick)


def bench_cases(quick):
    return [dataclasses.replace(c, params={{"sweep": SWEEP}}) for c in base.bench_cases(quick)]
'''


def test_bench_sweep_naming_no_parameter_is_one_line_and_exit_2(tmp_path):
    for sweep, why in (('"S"', "which its params lack"), ('"sweep"', "not a number there")):
        suite = tmp_path / f"bad_sweep_{len(why)}.py"
        suite.write_text(BAD_SWEEP.replace("SWEEP", sweep))
        run = cli("run", "--bench", "--suite-path", str(suite), "--topology", "tp=1", "--no-progress",
                  "--out", str(tmp_path / f"run{len(why)}"))
        assert run.returncode == 2, run.stdout + run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert "dtensor_memory.scale_exp [r64c256]: params['sweep']" in lines[0] and why in lines[0], lines[0]
        assert not (tmp_path / f"run{len(why)}").exists()  # a run that never began leaves nothing behind
