"""`shardcheck fuzz`: draw cases from each op's FuzzSpace with hypothesis, run them on the ranks, and shrink the
first failure to the smallest case that still fails the same way.

Per op, one hypothesis search: `@given(space.params(topologies))`, seeded by `--seed` (the same seed draws the same
examples), `--examples` of them (or until `--time` runs out).  An example is one item, run exactly as `shardcheck
run` runs an item (shardcheck.harness.driver.launch.run_plan: the same --timeout, hang budget and watchdog), its rows
read back.  The first failing example fixes the failure's signature (its first failing check, the status and the
symptom or error type: `grad:logits fail values`); from then on only examples failing with that signature count as
failing, so hypothesis shrinks toward a smaller case of the same failure rather than wander off to another.  The
example hypothesis ends on is the smallest it found.

Hypothesis's example database lives in the run directory (<out>/hypothesis/), new for every run: a later run
never replays an earlier run's examples, so the same --seed gives the same search.  The memory of failures across
runs is the corpus (harness/driver/corpus.py), which `shardcheck run` replays.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.harness.core.compare import FAILING
from shardcheck.harness.core.fuzz_space import FuzzSpace
from shardcheck.harness.core.plan_data import Plan
from shardcheck.harness.core.records import RESULTS, RecordWriter
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.driver.launch import run_plan
from shardcheck.harness.driver.planner import plan_fuzz_example
from shardcheck.harness.driver.pool import WorkerPool


@dataclass
class Example:
    """One example run: its params, its rows, and how it failed (None: it passed)."""

    params: dict
    rows: list[dict]
    signature: tuple[str, str, str] | None


@dataclass
class OpSearch:
    """The search of one op: how many examples ran, and the failure found (the shrunk example), if any."""

    suite: str
    op: str
    examples: int = 0  # examples run, shrinking included
    examples_to_failure: int = 0  # examples run up to and including the first failure
    seconds: float = 0.0
    first: Example | None = None  # the first failing example
    failure: Example | None = None  # the smallest failing example of the same signature
    stopped: str = ""  # why the search ended early (--time), if it did
    note: str = ""  # anything else the user should know (a failure hypothesis could not reproduce)

    @property
    def verdict(self) -> str:
        return "fail" if self.failure else ("stopped" if self.stopped and not self.examples else "pass")

    def summary(self) -> str:
        """The op's verdict as `shardcheck fuzz` prints it: examples run, and the shrunk failure with its params."""
        head = f"{self.op}: {self.examples} example(s) of suite {self.suite} in {self.seconds:.0f} s"
        if self.failure is None:
            why = f" ({self.stopped})" if self.stopped else ""
            return f"PASS {head}, no failure{why}" + (f"; {self.note}" if self.note else "")
        first, shrunk = self.first, self.failure
        lines = [
            f"FAIL {head}: {' '.join(shrunk.signature)}, first at example {self.examples_to_failure}, shrunk from",
            f"    {params_text(first.params)}",
            "  to",
            f"    {params_text(shrunk.params)}",
        ]
        if self.stopped:
            lines.append(f"  ({self.stopped})")
        if self.note:
            lines.append(f"  ({self.note})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "suite": self.suite,
            "op": self.op,
            "verdict": self.verdict,
            "examples": self.examples,
            "examples_to_failure": self.examples_to_failure,
            "seconds": round(self.seconds, 1),
            "stopped": self.stopped,
            "note": self.note,
            "first": self.first and {"params": self.first.params, "signature": list(self.first.signature)},
            "failure": self.failure and {"params": self.failure.params, "signature": list(self.failure.signature)},
        }


def params_text(params: dict) -> str:
    """A fuzz case's params in one line: `dp1-cp1-tp2 float32: b=2, s=5` (`dp4-ep2-cp1-tp1 ...` where ep > 1)."""
    rest = ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("topology", "dtype"))
    return f"{Topology(*params['topology'])} {params['dtype']}: {rest}"


def signature(rows: list[dict]) -> tuple[str, str, str] | None:
    """How an example failed: (check, status, symptom or error type) of its first failing check in check-name
    order (forward, grad:..., property:...), None when nothing fails.  Warnings do not fail an example."""
    bad = [r for r in rows if r["status"] in FAILING]
    if not bad:
        return None
    first = min(bad, key=lambda r: r["check"])
    return first["check"], first["status"], first.get("error_type") or first.get("symptom") or ""


class _FailsTheSameWay(Exception):
    """Raised in the hypothesis test body for an example that fails with the search's signature."""


class _OutOfTime(BaseException):
    """--time is up: ends the hypothesis search (a BaseException, which hypothesis does not take for a failure)."""


@dataclass
class FuzzSession:
    """What every example of a `shardcheck fuzz` run shares: the run's settings (`base`, a Plan without items),
    the topologies the spaces draw from, where examples run, and the ranks they run on (`pool`: one start-up per
    world size for the whole session, not one per example)."""

    base: Plan
    topologies: list[Topology]
    run_dir: Path
    pool: WorkerPool
    examples: int = 100
    seconds: float | None = None  # --time: the whole run's wall-clock budget
    hang_budget: bool = True
    started: float = field(default_factory=time.time)
    _count: int = 0

    def out_of_time(self) -> bool:
        return self.seconds is not None and time.time() - self.started > self.seconds

    def run_example(self, suite: str, space: FuzzSpace, params: dict) -> Example:
        """Run the fuzz case `params` describes, as `shardcheck run` runs an item; its rows and signature.  Every
        example goes through here."""
        self._count += 1
        scratch = self.run_dir / "examples" / f"{self._count:06d}"
        writer = RecordWriter(scratch)
        try:
            run_plan(
                plan_fuzz_example(self.base, suite, space, params),
                scratch,
                writer,
                show_progress=False,
                hang_budget=self.hang_budget,
                pool=self.pool,
            )
        finally:
            writer.close()
        rows = [json.loads(line) for line in (scratch / RESULTS).read_text().splitlines() if line.strip()]
        shutil.rmtree(scratch, ignore_errors=True)
        return Example(params, rows, signature(rows))

    def search(self, suite: str, space: FuzzSpace, on_example=None) -> OpSearch:
        """One op's hypothesis search (see the module's docstring)."""
        from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
        from hypothesis.database import DirectoryBasedExampleDatabase
        from hypothesis.errors import Flaky, HypothesisException

        found = OpSearch(suite, space.op)
        started = time.time()

        @settings(
            max_examples=self.examples,
            deadline=None,
            derandomize=False,
            report_multiple_bugs=False,
            database=DirectoryBasedExampleDatabase(self.run_dir / "hypothesis"),
            print_blob=False,
            phases=[Phase.generate, Phase.shrink],
            verbosity=Verbosity.quiet,
            suppress_health_check=list(HealthCheck),
        )
        @seed(self.base.seed)
        @given(space.params(self.topologies))
        def example(params: dict) -> None:
            if self.out_of_time():
                raise _OutOfTime
            ran = self.run_example(suite, space, params)
            found.examples += 1
            if on_example:
                on_example(found, ran)
            if ran.signature is None:
                return
            if found.first is None:
                found.first, found.examples_to_failure = ran, found.examples
            if ran.signature == found.first.signature:
                found.failure = ran  # hypothesis only tries smaller examples from now on: the last is the smallest
                raise _FailsTheSameWay(ran.signature)

        # One database key per op, so that the ops' saved examples stay apart.
        example._hypothesis_internal_database_key = f"{suite}/{space.op}".encode()
        try:
            example()
        except _FailsTheSameWay:
            pass
        except _OutOfTime:
            found.stopped = "--time ran out" + (
                " while shrinking: the case is the smallest found so far" if found.failure else ""
            )
        except Flaky as exc:  # the failure did not reproduce: keep what was seen, say so
            found.note = f"hypothesis: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        except HypothesisException as exc:  # e.g. no legal topology among those given
            found.stopped = (
                f"hypothesis could not draw from the space: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            )
        found.seconds = time.time() - started
        return found
