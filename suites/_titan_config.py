"""A user's torchtitan job config (`shardcheck run --model-config "--module llama3 --config llama3_8b ..."`) as one
titan model case: the same model at a small size under torchtitan's own parallelize, at the config's parallel degrees
scaled onto at most MAX_WORLD CPU ranks.

torchtitan 0.3.0 has no job-config file: a job is `--module M --config FN` (a function of M's config registry that
returns a `Trainer.Config`) and `--section.key value` overrides, parsed by its `ConfigManager` (tyro).  `load` runs
exactly that.  From the loaded config the case takes:
- the model: `model_spec.name` (llama3; qwen3 with MoE layers) and its first layer's head counts, RoPE config, expert
  count and top-k (`arch`); everything else is the titan suite's tiny config (2 layers, head dim 4, vocab 32; weights
  random: suites/_titan_models.py);
- the parallelism (`scale`): tensor_parallel_degree, data_parallel_shard_degree, data_parallel_replicate_degree,
  context_parallel_degree, expert_parallel_degree and enable_sequence_parallel; each degree reduced to a power of two
  dividing it where the world would exceed MAX_WORLD, pipeline parallelism dropped, the SPMD backend the suite's.
  Each reduction is a note the command prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import shlex
import warnings
from dataclasses import dataclass

from shardcheck.suites import _titan_models as titan
from shardcheck.suites import titan as titan_suite
from shardcheck.suites._model_config import ModelConfigError

MAX_WORLD = 4
FAMILY = "model_config"  # the generated suite's (harness/driver/model_config.py)
# the dims torchtitan's ParallelismConfig names, in the order they keep ranks when the world must shrink (cp before
# dp_shard: a job's dp_shard is mostly -1, the rest of the world, and its CP is what it asks to be checked)
DEGREES = (
    ("tensor_parallel_degree", "tp"),
    ("context_parallel_degree", "cp"),
    ("data_parallel_shard_degree", "dp_shard"),
    ("data_parallel_replicate_degree", "dp_replicate"),
)
MODELS = "llama3, qwen3 (its MoE flavors)"
MOE_DTYPES = ("float32",)


def is_job_config(spec: str) -> bool:
    """Whether a `--model-config` value is torchtitan's job arguments (it names `--module`), not a model folder."""
    try:
        words = shlex.split(spec)
    except ValueError:
        return False
    return any(w == "--module" or w.startswith("--module=") for w in words)


@contextlib.contextmanager
def _quiet():
    """torchtitan's loading prints warnings (a missing tokenizer folder ...) and tyro its usage: none of it ours."""
    out = io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(max(disabled, logging.WARNING))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield out
    finally:
        logging.disable(disabled)


def _tyro_message(text: str) -> str:
    """The message of tyro's error box (its title, a rule, the message, a rule, ...), as one line."""
    parts, part = [], []
    for line in text.splitlines():
        inner = line.strip().strip("│|╭╰").strip()
        if inner and set(inner) <= set("─-"):  # a rule: the box's, or between its sections
            parts.append(part)
            part = []
        elif inner:
            part.append(inner)
    parts.append(part)
    message = parts[1] if len(parts) > 1 and parts[1] else parts[0]
    return " ".join(message) or "tyro refused the arguments"


def load(spec: str):
    """torchtitan's `Trainer.Config` of the job arguments `spec` (ModelConfigError: one line saying why not)."""
    missing = titan.titan_missing()
    if missing:
        raise ModelConfigError(f"--model-config {spec!r}: {missing}")
    try:
        args = shlex.split(spec)
    except ValueError as exc:
        raise ModelConfigError(f"--model-config {spec!r}: {exc}") from None
    from torchtitan.config import ConfigManager

    with _quiet() as printed:
        try:
            return ConfigManager().parse_args(args)
        except SystemExit:  # tyro: an override it cannot parse (its message captured)
            why = _tyro_message(printed.getvalue())
        except (ValueError, ImportError, AttributeError, TypeError, KeyError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    raise ModelConfigError(f"--model-config {spec!r}: torchtitan cannot load it: {why}")


def model_of(config) -> str:
    """The titan suite's model of the config's `model_spec` (ModelConfigError where the suite builds none)."""
    spec = config.model_spec
    name = getattr(spec, "name", None)
    layers = getattr(getattr(spec, "model", None), "layers", None) or []
    if name == "llama3":
        return "llama3"
    if name == "qwen3" and layers and getattr(layers[0], "moe", None) is not None:
        return "qwen3_moe"
    flavor = getattr(spec, "flavor", "?")
    raise ModelConfigError(f"torchtitan model {name!r} (flavor {flavor!r}) is not one the titan suite builds: {MODELS}")


def arch_of(config, model: str) -> titan.Arch:
    """What the tiny config keeps of the user's model: its first layer's head counts, RoPE, experts and top-k."""
    layer = config.model_spec.model.layers[0]
    attention = layer.attention
    heads = attention.n_heads
    kv_heads = getattr(attention, "n_kv_heads", None) or heads
    if model not in titan.MOE_MODELS:
        return titan.Arch(heads=heads, kv_heads=kv_heads, rope=attention.rope)
    moe = layer.moe
    return titan.Arch(
        heads=heads, kv_heads=kv_heads, experts=moe.num_experts, top_k=moe.router.top_k, rope=attention.rope
    )


@dataclass(frozen=True)
class Mapping:
    """The config's parallelism on CPU ranks: torchtitan's degrees, and what was changed to get there."""

    degrees: titan.Degrees
    expert_parallel: bool
    sequence_parallel: bool
    notes: tuple[str, ...]

    @property
    def dp(self) -> int:
        return self.degrees.dp_shard * self.degrees.dp_replicate

    @property
    def topology(self) -> str:
        """The harness's topology of these degrees (`--topology`)."""
        d = self.degrees
        return f"dp={self.dp},cp={d.cp},tp={d.tp}" + (f",dp_replicate={d.dp_replicate}" if d.dp_replicate > 1 else "")

    def fits(self, t) -> bool:
        d = self.degrees
        return (t.dp, t.cp, t.tp, t.dp_replicate) == (self.dp, d.cp, d.tp, d.dp_replicate)


def _fit(value: int, budget: int) -> int:
    """The largest power of two within `budget` dividing `value` (-1, torchtitan's "the rest of the world": budget)."""
    if value == -1:
        return budget
    return next(d for d in (4, 2, 1) if d <= budget and value % d == 0)


def _data_degrees(p) -> tuple[dict[str, int], list[str]]:
    """tp, cp, dp_shard, dp_replicate scaled: the first two dims in use keep ranks (two of them: 2 x 2 = MAX_WORLD)."""
    used = [(field, short) for field, short in DEGREES if getattr(p, field) == -1 or getattr(p, field) > 1]
    budget = MAX_WORLD if len(used) <= 1 else MAX_WORLD // 2
    scaled, notes = {short: 1 for _, short in DEGREES}, []
    for i, (field, short) in enumerate(used):
        value = getattr(p, field)
        scaled[short] = _fit(value, budget) if i < 2 else 1
        if scaled[short] != value:
            why = " (the rest of the world)" if value == -1 else ""
            why += f" (world size {MAX_WORLD} at most: two of tp, cp, dp_shard, dp_replicate fit)" if i >= 2 else ""
            notes.append(f"{field} {value}{why} -> {scaled[short]}")
    return scaled, notes


def scale(p, model: str, arch: titan.Arch) -> Mapping:
    """The ParallelismConfig `p` of a job on CPU ranks (the module docstring says what changes)."""
    scaled, notes = _data_degrees(p)
    balancer = getattr(p, "context_parallel_load_balancer", "headtail")
    if scaled["cp"] > 1 and balancer != "headtail":  # the suite's SDPA ring attention is torch's head-tail one
        notes.append(f"context_parallel_load_balancer {balancer} -> headtail (the suite's attention is SDPA)")
    if p.pipeline_parallel_degree > 1:
        notes.append(f"pipeline_parallel_degree {p.pipeline_parallel_degree} -> 1 (not run: the titan suite has no PP)")
    wanted, ep = p.expert_parallel_degree, scaled["dp_shard"] * scaled["cp"] * scaled["tp"]
    expert_parallel = model in titan.MOE_MODELS and wanted > 1 and ep > 1 and arch.experts % ep == 0
    if wanted > 1 and model not in titan.MOE_MODELS:
        notes.append(f"expert_parallel_degree {wanted} -> 1 (the model has no experts)")
    elif wanted > 1 and not expert_parallel:
        notes.append(
            f"expert_parallel_degree {wanted} -> 1 (no dp_shard x cp x tp ranks dividing {arch.experts} experts)"
        )
    elif expert_parallel and wanted != ep:
        notes.append(f"expert_parallel_degree {wanted} -> {ep} (EP over the dp_shard x cp x tp ranks, efsdp 1)")
    if p.spmd_backend != titan_suite.BACKEND:
        notes.append(f"spmd_backend {p.spmd_backend} -> {titan_suite.BACKEND} (the backend the titan suite checks)")
    degrees = titan.Degrees(
        tp=scaled["tp"],
        dp_shard=scaled["dp_shard"],
        ep=ep if expert_parallel else 1,
        dp_replicate=scaled["dp_replicate"],
        cp=scaled["cp"],
    )
    return Mapping(degrees, expert_parallel, p.enable_sequence_parallel, tuple(notes))


def _check_heads(arch: titan.Arch, m: Mapping, spec: str) -> None:
    if arch.heads % m.degrees.tp or arch.kv_heads % m.degrees.tp:
        raise ModelConfigError(
            f"--model-config {spec!r}: tp {m.degrees.tp} does not divide the heads ({arch.heads}, {arch.kv_heads} kv)"
        )


def plan(spec: str) -> tuple[str, titan.Arch, Mapping]:
    """(the titan suite's model, its Arch, the Mapping) of the job arguments `spec`; ModelConfigError: one line."""
    config = load(spec)
    try:
        model = model_of(config)
    except ModelConfigError as exc:
        raise ModelConfigError(f"--model-config {spec!r}: {exc}") from None
    arch = arch_of(config, model)
    mapping = scale(config.parallelism, model, arch)
    _check_heads(arch, mapping, spec)
    return model, arch, mapping


def cases(spec: str) -> list:
    """The job's one model case: the titan suite's case of its model and degrees, at exactly the mapped topology."""
    model, arch, m = plan(spec)
    case = titan_suite.case(
        model,
        m.expert_parallel,
        m.sequence_parallel,
        fsdp=m.dp > 1,
        context_parallel=m.degrees.cp > 1,
        arch=arch,
        supports=m.fits,
        params={"titan_config": spec, "degrees": m.topology, "reduced": "; ".join(m.notes)},
    )
    if model not in titan.MOE_MODELS:
        return [dataclasses.replace(case, op=f"{FAMILY}.parallelize")]
    # the user's routers are not redrawn for a margin (top 8 of 128 finds none): float32 only, as bfloat16 could flip
    # a top-k between two correct runs
    margin_free = titan.build(model, arch, margin=False)
    return [dataclasses.replace(case, op=f"{FAMILY}.parallelize", build=margin_free, dtypes=MOE_DTYPES)]
