"""The golden of one item: full inputs in the item's dtype, the float64 reference's outputs and gradients, and the
reference run in the item's dtype (its budget).  The same on every rank, so the ranks a driver started share it: the
first rank of a launch that needs one works it out and leaves it in a folder every launch of the run reads
(`share_folder`); its peers, and the launches of other sizes that reach the same case, load it instead of working it
out again (the golden of an item at world size 4 was worked out four times, and again by the 1- and 2-rank launches)."""

from __future__ import annotations

import copyreg
import hashlib
import io
import json
import os
import pickle
import time
from pathlib import Path

import torch

from shardcheck.harness.core.case import Case, as_tuple, is_float
from shardcheck.harness.core.compare import BudgetScope, budget, finite_max_abs
from shardcheck.harness.core.model_case import StepCase, check_kind
from shardcheck.harness.core.plan_data import DTYPES, Item
from shardcheck.reference import low_precision_math


def _detach(t):
    return t.detach() if isinstance(t, torch.Tensor) else t  # an output may legitimately be None


class Golden:
    """Full inputs in the item's dtype, the float64 golden outputs and gradients, and the
    reference run in the item's dtype (for the low-precision budget).  Same on every rank."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int, n_summands: int, state: dict | None = None):
        """Worked out from the case, or taken from `state` (another rank's `state()` of the same case, dtype, seed and
        summands)."""
        self.case, self.n_summands, self.dtype = case, n_summands, dtype
        self._own: dict[int, Golden] = {}  # summand -> the golden of that summand alone (own_summand)
        self._precision_runs: dict[str, tuple] = {}
        self._kind_scales: dict[object, float] = {}
        self._kinds: list | None = None  # each output's kind (_output_kinds), worked out once
        self.budgets: dict = {}  # the budgets of its tensors, worked out once (judge.Budget.full)
        if state is not None:
            self.inputs, self.upstream = state["inputs"], state["upstream"]
            self.outputs, self.grads = state["outputs"], state["grads"]
            self.naive_outputs, self.naive_grads = state["naive_outputs"], state["naive_grads"]
            if isinstance(case, StepCase):
                case.output_names  # noqa: B018  (names the model's step here, as working the golden out does)
            return
        gen = torch.Generator().manual_seed(seed)
        raw = case.make_inputs(gen)
        # Low-precision inputs are the float64 ones rounded; the golden sees the rounded values,
        # so input rounding is not counted as error.
        self.inputs = {k: v.to(dtype) if is_float(v) else v for k, v in raw.items()}
        self.upstream: list[torch.Tensor | None] = []
        if case.bad_input is not None and case.bad_input.interpretation is None:  # no answer to compare against
            self.outputs = self.naive_outputs = ()
            self.grads = self.naive_grads = {}
            return
        self.outputs, self.grads = self._reference(
            case, {k: v.double() if is_float(v) else v for k, v in self.inputs.items()}, gen, n_summands
        )
        if dtype == torch.float64:
            self.naive_outputs, self.naive_grads = self.outputs, self.grads
        else:
            self.naive_outputs, self.naive_grads = self._reference(case, self.inputs, None, n_summands)

    def state(self) -> dict:
        """What another rank needs to make the same golden without working it out (`Golden(..., state=...)`)."""
        names = ("inputs", "upstream", "outputs", "grads", "naive_outputs", "naive_grads")
        return {name: getattr(self, name) for name in names}

    def own_summand(self, summand: int) -> Golden:
        """The golden of summand `summand`'s upstream gradient alone (GradConvention.OWN: a rank's own upstream
        gradient, as DTensor's backward of a replicated output takes it), worked out once, when asked."""
        if summand not in self._own:
            state = {**self.state(), "upstream": [g if g is None else g[summand : summand + 1] for g in self.upstream]}
            own = Golden(self.case, self.dtype, 0, 1, state=state)
            exact = {k: v.double() if is_float(v) else v for k, v in self.inputs.items()}
            own.grads = own._reference(self.case, exact, None, 1)[1]
            own.naive_grads = (
                own.grads if self.dtype == torch.float64 else own._reference(self.case, self.inputs, None, 1)[1]
            )
            self._own[summand] = own
        return self._own[summand]

    def output_scale(self, index: int) -> float:
        """The scale of output `index`'s kind (compare.budget's floor): the largest finite golden magnitude among the
        outputs of its kind (an op's outputs are one kind; a model case's are its activations, the loss, the
        activations' gradients, the parameters' gradients and the parameters after the step)."""
        kinds = self._output_kinds()
        if kinds[index] not in self._kind_scales:
            mine = [finite_max_abs(o) for o, k in zip(self.outputs, kinds) if k == kinds[index]]
            self._kind_scales[kinds[index]] = max(mine, default=0.0)
        return self._kind_scales[kinds[index]]

    def grad_scale(self) -> float:
        """The scale of the inputs' gradients (one kind): their largest finite golden magnitude."""
        if "grad" not in self._kind_scales:
            self._kind_scales["grad"] = max(map(finite_max_abs, self.grads.values()), default=0.0)
        return self._kind_scales["grad"]

    def input_scale(self, gradient: bool) -> float:
        """The scale of the inputs that made an output (`gradient` False: the float inputs) or an input's gradient (the
        upstream gradients, each summand's and their sum): the largest finite magnitude among them.  A golden of exact
        zeros throughout is a cancellation at this scale (compare.budget's floor)."""
        key = ("input", gradient)
        if key not in self._kind_scales:
            if gradient:
                ups = [u for g in self.upstream if g is not None for u in (g, g.sum(0))]
                self._kind_scales[key] = max(map(finite_max_abs, ups), default=0.0)
            else:
                self._kind_scales[key] = max(map(finite_max_abs, self.inputs.values()), default=0.0)
        return self._kind_scales[key]

    def _output_kinds(self) -> list:
        # Once per golden: asked for every output judged, and a model case has hundreds (a regex match each).
        if self._kinds is None:
            if isinstance(self.case, StepCase):
                self._kinds = [check_kind(check) for check in self.case.forward_checks]
            else:
                self._kinds = ["output"] * len(self.outputs)
        return self._kinds

    def precision_run(self, kind: str) -> tuple[tuple, dict]:
        """(outputs, grads) of the reference as code with a legitimate precision difference computes
        them: "float32" on the inputs rounded to float32 (for a float64 item), "bfloat16 math" in the
        item's dtype without the float32 upcast (shardcheck.reference.low_precision_math).  Only run when a check
        fails, once per item."""
        if kind not in self._precision_runs:
            self._precision_runs[kind] = self._precision(kind)
        return self._precision_runs[kind]

    def precision_limits(self, kind: str, dtype: torch.dtype) -> tuple[tuple, dict]:
        """(outputs, {}) as precision_run gives them, each output reduced to its tensor-wide budget in `dtype` (one
        number: BudgetScope.TENSOR) against that run: a model case's precision step needs no more, and the run (every
        module's tensors of the step) is not kept."""
        key = f"{kind} limits"
        if key not in self._precision_runs:
            outs = (self._precision_runs.get(kind) or self._precision(kind))[0]
            limits = []
            for i, (gold, alt) in enumerate(zip(self.outputs, outs)):
                both = gold is not None and alt is not None
                scales = (self.output_scale(i), self.input_scale(gradient=False))
                b = budget(gold, alt, dtype, BudgetScope.TENSOR, *scales)[0] if both else None
                limits.append(None if b is None else float(b.reshape(-1)[0]) if b.numel() else 0.0)
            self._precision_runs[key] = (tuple(limits), {})
        return self._precision_runs[key]

    def _precision(self, kind: str) -> tuple[tuple, dict]:
        if kind == "float32":
            inputs = {k: v.float() if is_float(v) else v for k, v in self.inputs.items()}
            return self._reference(self.case, inputs, None, self.n_summands)
        with low_precision_math():
            return self._reference(self.case, self.inputs, None, self.n_summands)

    def _reference(self, case: Case, inputs: dict, gen, n_summands: int):
        inputs = {k: v.clone().requires_grad_(k in case.grad_inputs) for k, v in inputs.items()}
        with torch.enable_grad():
            outs = as_tuple(case.reference(inputs))
        if not case.grad_inputs:
            return tuple(_detach(o) for o in outs), {}
        if gen is not None:  # first (float64) pass draws the upstream gradients; never all ones
            for o in outs:
                if is_float(o) and o.requires_grad:
                    g = torch.randn((n_summands, *o.shape), generator=gen, dtype=torch.float64)
                    g[:, ~torch.isfinite(o.detach())] = 0.0  # no gradient flows from -inf/NaN outputs
                    self.upstream.append(g)
                else:
                    self.upstream.append(None)
        xs = [inputs[n] for n in case.grad_inputs]
        used = [(o, g) for o, g in zip(outs, self.upstream) if g is not None]
        # The golden backpropagates the summed upstream once.  A low-precision run backpropagates each
        # summand's upstream and adds the gradients in its dtype, as the ranks do (each rank's output is
        # its own summand): its error then includes the rounding of the summands, which can be larger
        # than their sum (CP ranks' gradients cancel), and the budget follows.
        summands = [None] if gen is not None else range(n_summands)
        total = [None] * len(xs)
        for s in summands:
            ups = [(g.sum(0) if s is None else g[s]).to(o.dtype) for o, g in used]
            grads = torch.autograd.grad([o for o, _ in used], xs, ups, allow_unused=True, retain_graph=s is not None)
            total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
        grads = {
            n: (g if g is not None else torch.zeros_like(x)).detach() for n, x, g in zip(case.grad_inputs, xs, total)
        }
        return tuple(_detach(o) for o in outs), grads


SHARE_FOLDER = "goldens"
SHARE_POLL = 0.002  # seconds between a rank's looks for the golden its launch's first rank is working out


def share_folder(workers_dir: Path, run_id: str) -> Path:
    """Where the launches of run `run_id` under `workers_dir` (a WorkerPool's) leave their goldens; the driver removes
    it when the run's launches are done."""
    return workers_dir / SHARE_FOLDER / hashlib.sha256(run_id.encode()).hexdigest()[:16]


class GoldenCache:
    """The goldens of the case and dtype being run (items come grouped by case and dtype; one per number of summands,
    which topologies differ in).  With a `share` folder (ranks a driver started: one machine), rank 0 works a missing
    golden out and leaves it there, and the other ranks wait for it (at most `timeout` seconds, then work it out
    themselves); a golden left there by another launch of the run is loaded by every rank."""

    def __init__(self, share: Path | None = None, rank: int = 0, timeout: float = 0.0) -> None:
        self.share, self.rank, self.timeout = share, rank, timeout
        self.key: tuple | None = None
        self.goldens: dict[int, Golden] = {}  # n_summands -> the golden of the case and dtype `key`

    def get(self, case: Case, item: Item, n_summands: int) -> Golden:
        key = (case.op, case.case_id, item.dtype, item.seed)
        if key != self.key:
            self.key, self.goldens = key, {}
        if n_summands not in self.goldens:
            self.goldens[n_summands] = self._golden(case, item, n_summands)
        return self.goldens[n_summands]

    def _golden(self, case: Case, item: Item, n_summands: int) -> Golden:
        dtype = DTYPES[item.dtype]
        if self.share is None:
            return Golden(case, dtype, item.seed, n_summands)
        path = self.share / _share_name(item, n_summands)
        state = _read(path)
        if state is None and self.rank != 0:
            state = self._wait(path)
        if state is not None:
            return Golden(case, dtype, item.seed, n_summands, state=state)
        try:
            golden = Golden(case, dtype, item.seed, n_summands)
        except Exception:
            if self.rank == 0:  # the peers work it out too, and raise as it did
                _leave(path.with_suffix(".failed"), b"")
            raise
        if self.rank == 0:
            _share(golden, path)
        return golden

    def _wait(self, path: Path) -> dict | None:
        """Rank 0's golden once it is there; None once it failed, or after `timeout` seconds (rank 0 died or is
        stuck: this rank works it out, and the item's barrier finds the peer missing as before)."""
        deadline = time.time() + self.timeout
        failed = path.with_suffix(".failed")
        while time.time() < deadline:
            state = _read(path)
            if state is not None:
                return state
            if failed.exists():
                return None
            time.sleep(SHARE_POLL)
        return None


def _share_name(item: Item, n_summands: int) -> str:
    """The file of an item's golden: its suite, case, dtype, seed and summands (a fuzz case's parameters too)."""
    key = [item.suite, item.op, item.case_id, item.dtype, item.seed, n_summands, item.fuzz]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32] + ".golden"


def _share(golden: Golden, path: Path) -> None:
    """Leave `golden` at `path` for the peers; where it cannot be (an input that does not pickle, a full disk), the
    marker that sends them to work it out themselves."""
    try:
        data = _dumps(golden.state())
    except Exception:
        data = None
    if data is None or not _leave(path, data):
        _leave(path.with_suffix(".failed"), b"")


def _leave(path: Path, data: bytes) -> bool:
    """Write `data` to `path` whole (a reader never sees part of it); whether it could."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def _read(path: Path) -> dict | None:
    """The golden left at `path`, or None (none there yet; one that does not load is as good as none)."""
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # FileNotFoundError, mostly
        return None


# A golden's tensors pickled as their bytes (4x cheaper than torch.save's archive for the small tensors of a case).
def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _tensor_as_bytes(t: torch.Tensor) -> tuple:
    flat = t.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _tensor_from_bytes, (data, str(t.dtype).removeprefix("torch."), tuple(t.shape))


_PICKLING = copyreg.dispatch_table.copy()
_PICKLING[torch.Tensor] = _tensor_as_bytes


def _dumps(state: dict) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _PICKLING
    pickler.dump(state)
    return out.getvalue()
