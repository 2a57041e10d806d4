"""Signatures of a module under test against its family's default module, and calls by keyword.

A family's default module (`Plan.default_impl`, harness/rank/suite_loader.py) is its seed module (our
`shardcheck.distributed_impl.<family>`) for the five built-in families, the IMPLEMENTATION its suite names for a
new one; "the seed" below is that module.  Before a run with `--impl FAMILY=...`, every selected op of
that family is compared with the seed's signature (`inspect.signature`; an autograd Function by its
`forward` without ctx, another class by its `__init__` without self).  Each op a caller of the seed API
cannot call as the seed is one failing `property:signature` row: the name is missing, a seed parameter
is missing or renamed, re-ordered or moved behind an extra one, or a parameter is required that the
seed lacks or makes optional.  Extra optional parameters after the seed's serve every such caller: no
finding.

The worker then calls a foreign module's ops by keyword wherever the seed names the parameter
(`KeywordCalls`), so a re-ordered signature costs one finding, not a TypeError per item; a renamed parameter
(with the seed's default) goes by the module's name, and one the module lacks is left out where the call passes
its default, so an older signature (a pre-fix copy's) is judged on its values.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from shardcheck.harness.core.citations import SIGNATURE_RULE
from shardcheck.harness.core.modules import resolve_impl, same_module
from shardcheck.harness.core.records import NO_CAUSE, SIGNATURE_CHECK, Status, Symptom

SEED_PACKAGE = "distributed_impl"

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def seed_module(family: str, default: str | None = None) -> ModuleType:
    """The module a family's signatures are compared with: `default` (Plan.default_impl), else our seed module."""
    if default is None:
        return importlib.import_module(f"{SEED_PACKAGE}.{family}")
    return resolve_impl(family, default, f"{family}'s default implementation {default}")


def is_foreign(spec: str | None, default: str | None) -> bool:
    """Whether `spec` puts someone else's module under test (not the family's default), with a default to
    compare it with."""
    return bool(spec) and default is not None and not same_module(spec, default)


def under_test(family: str, spec: str, default: str | None) -> Any:
    """The module under test as the ranks call it: someone else's module (not the family's default) calls its
    ops by the default's parameter names (KeywordCalls)."""
    module = resolve_impl(family, spec)
    return KeywordCalls(module, seed_module(family, default), family, default) if is_foreign(spec, default) else module


def used_by_one_case(module: Any) -> Any:
    """A used family's module (Case.uses) for one case's run: someone else's module as a fresh KeywordCalls that
    records the seed functions this case looks up (used_drift), so that it is judged on those alone."""
    return module.fresh() if isinstance(module, KeywordCalls) else module


def used_drift(modules: dict[str, Any], reported: set[str] = frozenset()) -> tuple[bool, list[str]]:
    """(whether any used family is someone else's module and the case looked up a seed function of it, the
    drifts: 'cp_utils.make_cp_batch_and_ctx: signature: ...') of a case's used modules (used_by_one_case) after
    its run.  The drift of a function the case never called is not its finding: the family's own suite has it; nor
    is one of an op in `reported` (selected in the run: its own signature row, before any case, is the one line)."""
    looked_up, found = False, []
    for family, module in sorted(modules.items()):
        if not isinstance(module, KeywordCalls):
            continue
        names = [n for n in module.called if f"{family}.{n}" not in reported]
        looked_up = looked_up or bool(names)
        found += [f"{family}.{name}: {message}" for name, (_, message) in module.drift().items() if name in names]
    return looked_up, found


def call_signature(obj: Any) -> inspect.Signature | None:
    """How callers call `obj`: an autograd Function's forward minus ctx (its `apply`), a class's
    __init__ minus self, a function's own signature; None for anything else."""
    try:
        if inspect.isclass(obj) and issubclass(obj, torch.autograd.Function):
            params = list(inspect.signature(obj.forward).parameters.values())
            if obj.setup_context is torch.autograd.Function.setup_context:  # old style: forward(ctx, ...)
                params = params[1:]
            return inspect.Signature(params)
        if inspect.isclass(obj):
            return inspect.Signature(list(inspect.signature(obj.__init__).parameters.values())[1:])
        if callable(obj):
            return inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return None


def differences(seed: inspect.Signature, impl: inspect.Signature) -> tuple[str, list[str]]:
    """(Status.PASS, []) when every call of the seed API also calls `impl` with the same meaning, else
    (Status.FAIL, reasons): a seed parameter missing or renamed, taken at another position, by position only or by
    keyword only where the seed takes it either way, required where the seed gives it a default, or a parameter the
    seed lacks that is required or sits before a seed parameter callers pass by position.  Extra optional parameters
    after the seed's are compatible: no finding."""
    s = {n: p for n, p in seed.parameters.items() if p.kind not in _VARIADIC}
    i = {n: p for n, p in impl.parameters.items() if p.kind not in _VARIADIC}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in impl.parameters.values())
    seed_pos = [n for n, p in s.items() if p.kind in _POSITIONAL]
    impl_pos = [n for n, p in i.items() if p.kind in _POSITIONAL]
    renamed = renamed_parameters(seed, impl)
    as_seed = {new: old for old, new in renamed.items()}
    i = {as_seed.get(n, n): p for n, p in i.items()}
    impl_pos = [as_seed.get(n, n) for n in impl_pos]
    fails = [f"parameter {old} renamed {new}" for old, new in renamed.items()]
    missing = [n for n in s if n not in i and not takes_kwargs]
    if missing:
        fails.append("missing parameter(s) " + ", ".join(missing))
    common = [n for n in seed_pos if n in impl_pos]
    if common != [n for n in impl_pos if n in seed_pos]:
        fails.append(
            f"parameters in another order: ({', '.join(n for n in impl_pos if n in seed_pos)}), "
            f"the seed has ({', '.join(common)})"
        )
    elif common:  # same order, but an extra parameter among them shifts the seed's that follow it
        extra = [n for n in impl_pos[: impl_pos.index(common[-1])] if n not in s]
        if extra:
            shifted = [n for n in common if impl_pos.index(n) > impl_pos.index(extra[0])]
            fails.append(
                f"extra parameter(s) {', '.join(extra)} before the seed's {', '.join(shifted)}: "
                "callers passing those by position reach another parameter"
            )
    keyword_only = [n for n in seed_pos if n in i and i[n].kind is inspect.Parameter.KEYWORD_ONLY]
    if keyword_only:
        fails.append("keyword-only parameter(s) the seed takes by position: " + ", ".join(keyword_only))
    positional_only = [
        n
        for n, p in s.items()
        if p.kind is not inspect.Parameter.POSITIONAL_ONLY
        and n in i
        and i[n].kind is inspect.Parameter.POSITIONAL_ONLY
        and n not in renamed
    ]
    if positional_only:
        fails.append("positional-only parameter(s) the seed takes by keyword: " + ", ".join(positional_only))
    now_required = [
        n
        for n, p in s.items()
        if p.default is not inspect.Parameter.empty and n in i and i[n].default is inspect.Parameter.empty
    ]
    if now_required:
        fails.append("required parameter(s) the seed makes optional: " + ", ".join(now_required))
    required = [n for n in i if n not in s and i[n].default is inspect.Parameter.empty]
    if required:
        fails.append("extra required parameter(s) " + ", ".join(required))
    return (Status.FAIL, fails) if fails else (Status.PASS, [])


def renamed_parameters(seed: inspect.Signature, impl: inspect.Signature) -> dict[str, str]:
    """{seed name: impl name} of each seed parameter absent by name whose position holds a parameter the seed lacks."""
    s = {n for n, p in seed.parameters.items() if p.kind not in _VARIADIC}
    i = {n for n, p in impl.parameters.items() if p.kind not in _VARIADIC}
    seed_pos = [n for n, p in seed.parameters.items() if p.kind in _POSITIONAL]
    impl_pos = [n for n, p in impl.parameters.items() if p.kind in _POSITIONAL]
    return {n: impl_pos[k] for k, n in enumerate(seed_pos) if n not in i and k < len(impl_pos) and impl_pos[k] not in s}


def _untyped(sig: inspect.Signature) -> inspect.Signature:
    """The seed's signature as quoted: names, kinds and defaults, no annotations (the compared module is our
    implementation of the seed, whose types are ours, not the seed's; the comparison reads names alone)."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def check_names(
    family: str, module: ModuleType, names: list[str], default: str | None = None
) -> dict[str, tuple[str, str]]:
    """{name: (status, message)} for each of `names` whose signature in `module` differs from the seed's
    (`default`: the family's default module, as seed_module takes it)."""
    seed = seed_module(family, default)
    out = {}
    for name in names:
        seed_sig = call_signature(getattr(seed, name, None))
        if seed_sig is None:
            continue
        if not hasattr(module, name):
            out[name] = (Status.FAIL, f"signature: {name} is not defined in the module under test")
            continue
        impl_sig = call_signature(getattr(module, name))
        if impl_sig is None:
            out[name] = (Status.FAIL, f"signature: {name} is not callable like the seed's {name}{_untyped(seed_sig)}")
            continue
        status, reasons = differences(seed_sig, impl_sig)
        if status != Status.PASS:
            out[name] = (
                status,
                f"signature: {'; '.join(reasons)} (seed {name}{_untyped(seed_sig)}, under test {name}{impl_sig})",
            )
    return out


def signature_rows(plan, meta: dict) -> list[dict]:
    """The `property:signature` rows of a plan's foreign modules, in the one record format."""
    rows = []
    for family, spec in sorted(plan.impl.items()):
        default = plan.default_impl.get(family)
        if not is_foreign(spec, default):
            continue
        suites = {**{i.op: i.suite for i in plan.items}, **plan.missing_ops}
        ops = [op for op in suites if op.split(".", 1)[0] == family]
        found = check_names(family, resolve_impl(family, spec), [op.split(".", 1)[1] for op in ops], default)
        for name, (status, message) in found.items():
            op = f"{family}.{name}"
            rows.append(
                {
                    "run_id": plan.run_id,
                    "op": op,
                    "family": family,
                    "impl": spec,
                    "suite": suites[op],
                    "case_id": "signature",
                    "params": {},
                    "dp": 0,
                    "cp": 0,
                    "tp": 0,
                    "world_size": 0,
                    "dtype": "-",
                    "device": plan.device,
                    "backend": plan.backend,
                    "seed": plan.seed,
                    "check": SIGNATURE_CHECK,
                    "status": status,
                    "max_abs_err": None,
                    "max_rel_err": None,
                    "budget": None,
                    "err_ratio": None,
                    "err_naive": None,
                    "mismatch": None,
                    "message": message,
                    "per_rank": [],
                    **NO_CAUSE,
                    "symptom": Symptom.SIGNATURE,
                    "rule_source": str(SIGNATURE_RULE.source),
                    "rule_cite": SIGNATURE_RULE.cite,
                }
            )
    return rows


def _at_default(value: Any, parameter: inspect.Parameter) -> bool:
    """Whether a call passes `parameter` its own default (None, False, a number or string equal to it)."""
    default = parameter.default
    if default is inspect.Parameter.empty:
        return False
    return value is default or (
        type(value) is type(default) and isinstance(value, (bool, int, float, str)) and value == default
    )


def _names_in(seed: inspect.Signature, impl: inspect.Signature | None) -> dict[str, str | None]:
    """{seed name: the name `impl` takes it by, None where it lacks it} (the seed's own names where impl is unknown
    or takes **kwargs)."""
    if impl is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in impl.parameters.values()):
        return {n: n for n in seed.parameters}
    renamed = {  # taken as the same parameter only with the same default (required both, or equal defaults)
        old: new
        for old, new in renamed_parameters(seed, impl).items()
        if _at_default(impl.parameters[new].default, seed.parameters[old])
        or seed.parameters[old].default is impl.parameters[new].default is inspect.Parameter.empty
    }
    return {n: renamed.get(n, n if n in impl.parameters else None) for n in seed.parameters}


def _by_keyword(fn: Callable, seed: inspect.Signature, impl: inspect.Signature | None = None) -> Callable:
    """fn called with the arguments of a seed-API call passed by the seed's parameter names: a renamed one by the
    name `impl` gives it, and one `impl` lacks left out where the call passes its default (what a caller that omits
    it means), so that an older signature is judged on its values; the signature row has the difference."""
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in seed.parameters.values()):
        return fn
    names = _names_in(seed, impl)

    def call(*args, **kwargs):
        try:
            bound = seed.bind(*args, **kwargs)
        except TypeError:  # not a call of the seed API: leave it as it is
            return fn(*args, **kwargs)
        positional, keywords = [], {}
        for name, value in bound.arguments.items():
            kind = seed.parameters[name].kind
            if names[name] is None and _at_default(value, seed.parameters[name]):
                continue
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                keywords.update(value)
            else:
                keywords[names[name] or name] = value
        return fn(*positional, **keywords)

    call.__wrapped__ = fn  # the function itself, for whoever needs its globals (harness/core/restore.py)
    return call


class _FunctionByKeyword:
    """An autograd Function whose `apply` takes the seed's arguments by keyword."""

    def __init__(self, function: type, seed: inspect.Signature):
        self._function = function
        self.apply = _by_keyword(function.apply, seed, call_signature(function))

    def __getattr__(self, name: str):
        return getattr(self._function, name)


class KeywordCalls:
    """A module under test whose seed-named functions and autograd Functions are called by keyword; `called`: the
    seed names looked up through it, in order (family, default: what `drift` compares them with)."""

    def __init__(self, module: ModuleType, seed: ModuleType, family: str = "", default: str | None = None):
        self._module, self._seed = module, seed
        self._family, self._default = family, default
        self.called: dict[str, None] = {}

    def fresh(self) -> KeywordCalls:
        """The same module with nothing recorded yet."""
        return KeywordCalls(self._module, self._seed, self._family, self._default)

    def drift(self) -> dict[str, tuple[str, str]]:
        """{name: (status, message)} of the recorded names whose signature differs from the seed's (check_names)."""
        return check_names(self._family, self._module, list(self.called), self._default)

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        seed_sig = call_signature(getattr(self._seed, name, None))
        if seed_sig is None:
            return value
        self.called[name] = None
        if inspect.isclass(value) and issubclass(value, torch.autograd.Function):
            return _FunctionByKeyword(value, seed_sig)
        if inspect.isfunction(value):
            return _by_keyword(value, seed_sig, call_signature(value))
        return value
