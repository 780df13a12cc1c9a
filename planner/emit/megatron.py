"""Megatron-LM ``pretrain_gpt.py`` arguments for a plan: a pure mapping, then a launch script.

Flag names are Megatron-LM's own (``megatron/training/arguments.py``; the list plan3d relies on is
in tests/data/megatron_lm_arguments.txt with its source commit). Megatron's defaults differ from
Llama-style models (biases on, dropout 0.1, learned positions, LayerNorm, tied embeddings), so
every model-shape flag is written out explicitly.
"""

from __future__ import annotations

from planner.specs import Scenario

Flag = tuple[str, "str | None"]

# ZeRO stage -> Megatron flags: the distributed optimizer is ZeRO-1; Megatron FSDP shards more.
ZERO_FLAGS: dict[int, list[Flag]] = {
    0: [],
    1: [("--use-distributed-optimizer", None)],
    2: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads")],
    3: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params")],
}


def model_flags(sc: Scenario) -> list[Flag]:
    m = sc.model
    flags: list[Flag] = [
        ("--num-layers", str(m.num_layers)), ("--hidden-size", str(m.hidden_size)),
        ("--ffn-hidden-size", str(m.ffn_size)), ("--num-attention-heads", str(m.num_attention_heads)),
        ("--kv-channels", str(m.kv_channels)),
    ]
    if m.kv_heads != m.num_attention_heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", str(m.kv_heads))]
    flags += [("--vocab-size", str(m.vocab_size)), ("--make-vocab-size-divisible-by", "128"),
              ("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm")]
    if m.max_seq_len is not None:
        flags.append(("--max-position-embeddings", str(m.max_seq_len)))
    flags.append(("--position-embedding-type",
                  {"learned": "learned_absolute", "rope": "rope", "alibi": "none"}[m.position_embedding]))
    if m.activation == "swiglu":
        flags.append(("--swiglu", None))
    if not m.tied_embeddings:
        flags.append(("--untie-embeddings-and-output-weights", None))
    if not m.linear_bias:
        flags.append(("--disable-bias-linear", None))
        if m.has_qkv_bias:
            flags.append(("--add-qkv-bias", None))
    dropout = "0.1" if m.dropout else "0.0"
    flags += [("--attention-dropout", dropout), ("--hidden-dropout", dropout)]
    return flags


def parallel_flags(sc: Scenario) -> list[Flag]:
    p, tr = sc.resolved_plan(), sc.training
    flags: list[Flag] = [
        ("--tensor-model-parallel-size", str(p.tp)), ("--pipeline-model-parallel-size", str(p.pp)),
        ("--context-parallel-size", str(p.cp)),
    ]
    if p.vpp > 1:
        flags.append(("--num-layers-per-virtual-pipeline-stage", str(sc.model.num_layers // (p.pp * p.vpp))))
    if p.pp > 1 and sc.plan.layers_per_stage is not None:
        layers = p.layers_per_stage
        flags += [("--decoder-first-pipeline-num-layers", str(layers[0])),
                  ("--decoder-last-pipeline-num-layers", str(layers[-1]))]
    if p.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    if p.recompute == "selective":
        flags += [("--recompute-granularity", "selective")]
    elif p.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                  ("--recompute-num-layers", "1")]
    flags += ZERO_FLAGS[p.zero_stage]
    flags += [("--micro-batch-size", str(p.micro_batch_size)), ("--global-batch-size", str(tr.global_batch_size)),
              ("--seq-length", str(tr.seq_len)), ("--bf16", None)]
    if tr.precision == "fp8":
        flags += [("--fp8-format", "hybrid")]
    flags.append(("--attention-backend", "flash" if tr.attention == "flash" else "unfused"))
    if tr.overlap_grad_reduce:
        flags.append(("--overlap-grad-reduce", None))
        if p.zero_stage == 1:
            flags.append(("--overlap-param-gather", None))
    if tr.grad_reduce_in_bf16:
        flags.append(("--grad-reduce-in-bf16", None))
    return flags


def run_flags() -> list[Flag]:
    """What a benchmark run needs besides the plan: synthetic data, a null tokenizer, a few steps."""
    return [("--mock-data", None), ("--tokenizer-type", "NullTokenizer"), ("--train-iters", "${TRAIN_ITERS:-20}"),
            ("--lr", "1.0e-4"), ("--lr-decay-style", "constant"), ("--log-interval", "1")]


def megatron_flags(sc: Scenario) -> list[Flag]:
    """Every Megatron-LM flag of the plan, in order."""
    return model_flags(sc) + parallel_flags(sc) + run_flags()


def annotations(sc: Scenario) -> list[str]:
    """Facts no Megatron-LM flag carries, as ``# plan3d: key=value`` comments that `plan3d check` reads:
    the model's name, the GPU count (the launcher carries it in scripts, not in an argument file)
    and a BLOOM-style embedding norm."""
    notes = [f"name={sc.model.name}", f"num_gpus={sc.training.num_gpus}"]
    if sc.model.embedding_norm:
        notes.append("embedding_norm=true")
    return notes


def args_block(flags: list[Flag], indent: str = "  ") -> str:
    lines = []
    for flag, value in flags:
        if value is None:
            lines.append(f"{indent}{flag}")
        elif value.startswith("${"):
            lines.append(f'{indent}{flag} "{value}"')
        else:
            lines.append(f"{indent}{flag} {value}")
    return "\n".join(lines)


def header(sc: Scenario, what: str) -> str:
    notes = "\n".join(f"# plan3d: {n}" for n in annotations(sc))
    return (f"# {what} for {sc.model.name}: {sc.plan.label()} on {sc.training.num_gpus} x {sc.hardware.name}\n"
            f"# Written by plan3d; `plan3d check` reads this file back.\n{notes}\n")


def render_args(sc: Scenario) -> str:
    """An argument file: one Megatron-LM flag per line, comments allowed (`plan3d check` reads it;
    pass it on with ``$(grep -v '^#' FILE)``)."""
    body = args_block(megatron_flags(sc), indent="").replace('"${TRAIN_ITERS:-20}"', "20")
    return header(sc, "Megatron-LM pretrain_gpt.py arguments") + body + "\n"


def render(sc: Scenario, launcher: str) -> str:
    """A bash script that runs ``pretrain_gpt.py`` with the plan under the given launcher line."""
    return f"""#!/usr/bin/env bash
{header(sc, "Megatron-LM pretrain_gpt.py under torchrun")}# MEGATRON_LM points at a Megatron-LM checkout.
set -euo pipefail
MEGATRON_LM="${{MEGATRON_LM:-$PWD/Megatron-LM}}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

MEGATRON_ARGS=(
{args_block(megatron_flags(sc))}
)

{launcher} "$MEGATRON_LM/pretrain_gpt.py" "${{MEGATRON_ARGS[@]}}" "$@"
"""
