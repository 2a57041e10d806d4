"""The user's own Transformers model directory (`shardcheck run --model-config DIR`) as model cases: the same
architecture at a small size under Transformers' own tensor-parallel plan, against the same model on one device.

What is changed in the user's config (`shrink`), and nothing else: the layers cut to at most LAYERS; each attention
head to HEAD_DIM features (`head_dim`, where the config names one) with the head counts kept, so hidden_size =
num_attention_heads x HEAD_DIM; the MLP's and the experts' intermediate sizes to 2 x hidden_size; the vocabulary to
at most VOCAB (token ids beyond it set to None); max_position_embeddings to at least the sequence.  Attention is
"sdpa", experts "eager" (the grouped matmul has no float64 on CPU).  Weights are random (suites/_hf_models.py's).
Topology -> degrees as the hf suite's: tp_size = tp, no FSDP, no EP.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardcheck import Layout, ModelCase, Shard
from shardcheck.harness.core.plan_data import MODEL_CONFIG_SUITE
from shardcheck.suites import _hf_models as hf

LAYERS, HEAD_DIM, VOCAB = 2, 4, 64
EXPERT_ACT = "*.mlp.experts.act_fn"  # called once per local expert; under TP its output is split by columns
SUITE = MODEL_CONFIG_SUITE  # the generated suite's name (harness/driver/model_config.py)
FAMILY = "model_config"


class ModelConfigError(ValueError):
    """A model directory that cannot be checked: one line saying why."""


def load(path: str):
    """The Transformers config of `path` (a folder holding config.json, or the file), checked to have a TP plan."""
    missing = hf.hf_missing()
    if missing:
        raise ModelConfigError(f"--model-config {path}: {missing}")
    directory = Path(path).expanduser()
    if directory.is_file() and directory.name == "config.json":
        directory = directory.parent
    if not (directory / "config.json").is_file():
        raise ModelConfigError(f"--model-config {path}: no config.json there (a folder save_pretrained writes)")
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"--model-config {path}: Transformers cannot load it: {exc}".splitlines()[0]) from None
    if not getattr(cfg, "base_model_tp_plan", None):
        raise ModelConfigError(
            f"--model-config {path}: model type {cfg.model_type!r} has no tensor-parallel plan in Transformers "
            "(base_model_tp_plan); nothing to check"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # the step is next-token cross-entropy on logits
        raise ModelConfigError(
            f"--model-config {path}: model type {cfg.model_type!r} has no causal-LM class in Transformers "
            "(AutoModelForCausalLM); only causal language models are checked"
        )
    return cfg


def shrink(cfg):
    """`cfg` at a small size (the module docstring says exactly what changes)."""
    cfg.num_hidden_layers = min(cfg.num_hidden_layers, LAYERS)
    heads = cfg.num_attention_heads
    cfg.hidden_size = heads * HEAD_DIM
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = HEAD_DIM
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name, None):
            setattr(cfg, name, 2 * cfg.hidden_size)
    cfg.vocab_size = min(cfg.vocab_size, VOCAB)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) >= cfg.vocab_size:
            setattr(cfg, name, None)
    cfg.max_position_embeddings = max(getattr(cfg, "max_position_embeddings", 0) or 0, hf.SEQ)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


def head_counts(cfg) -> tuple[int, int]:
    return cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def build(path: str):
    def full_model(gen: torch.Generator) -> torch.nn.Module:
        """The user's architecture, shrunk, in float64, weights from `gen` (as the hf suite's)."""
        import transformers

        net = transformers.AutoModelForCausalLM.from_config(shrink(load(path)), dtype=torch.float64)
        hf.fill_weights(net, gen)
        return net

    return full_model


def make_inputs(vocab: int):
    def inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, vocab, (hf.BATCH, hf.SEQ + 1), generator=gen)
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return inputs


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def cases(path: str) -> list[ModelCase]:
    """The model at `path` under Transformers' TP plan (`<type>-tp`: every TP size dividing its query and key/value
    head counts) and, where it has an expert-parallel plan, under that plan with EP on the TP ranks (`<type>-ep`: ep
    == tp, which must divide the expert count too)."""
    cfg = shrink(load(path))
    heads, kv_heads = head_counts(cfg)
    experts = next((getattr(cfg, n) for n in EXPERT_COUNTS if getattr(cfg, n, None)), 0)

    def tp_fits(t) -> bool:
        return t.dp == 1 and t.cp == 1 and heads % t.tp == 0 and kv_heads % t.tp == 0

    def ep_fits(t) -> bool:
        return tp_fits(t) and experts % t.tp == 0

    # routers without a margin: no bfloat16 with experts; a type whose float64 step is float32-accurate: float64 items
    # judged with float32's budgets
    dtypes = hf.MOE_DTYPES if experts else hf.DTYPES

    def case(expert_parallel: bool) -> ModelCase:
        return ModelCase(
            op=f"{FAMILY}.parallelize",
            case_id=f"{cfg.model_type}-{'ep' if expert_parallel else 'tp'}",
            build=build(path),
            parallelize=hf.parallelize(expert_parallel=expert_parallel),
            make_inputs=make_inputs(cfg.vocab_size),
            model_inputs=("input_ids",),
            loss=hf.loss,
            # the experts' activation: under TP split by columns; under EP another expert on each rank (hf.py)
            activation_layouts={EXPERT_ACT: Layout(tp=Shard(-1))} if experts and not expert_parallel else {},
            unchecked_modules=(EXPERT_ACT,) if expert_parallel else (),
            supports=ep_fits if expert_parallel else tp_fits,
            dtypes=dtypes,
            compute_dtype=hf.COMPUTE_DTYPES.get(cfg.model_type),
            params={"model_config": str(Path(path).expanduser().resolve()), "model_type": cfg.model_type},
        )

    with_ep = bool(experts and getattr(cfg, "base_model_ep_plan", None))
    return [case(False), case(True)] if with_ep else [case(False)]
