"""MosaicML's published MPT training throughput (llm-foundry, Composer + PyTorch FSDP) against plan3d's prediction.

Run: python benchmarks/llm_foundry.py [--rows] [--scorer]

Data: benchmarks/data/llm_foundry_mpt.json (mosaicml/llm-foundry scripts/train/benchmarking/README.md, "MPT Training
Benchmarks": 201 measured runs on H100 80GB (BF16 and FP8), A100 80GB and A100 40GB, 125M to 70B parameters, 512 to 65,536 tokens,
8 to 128 GPUs, rows copied verbatim; the file's ``source``, ``model_note`` and ``mapping_note`` say what each field is
and what is not modelled). None of these runs was used to set any figure of plan3d: they are a held-out family
(another framework, GPT-style models with LayerNorm, GELU, biases and learned positions, long sequences). Step time
is what they test: their memory is not (the torchtitan profile's loss keeps fp32 copies of the logits, Composer's MPT
uses flash-attn's fused cross-entropy, ``mapping_note``), so a run called out of memory is printed and still scored.

Each run is pinned as it ran (``mapping_note``): ``--framework torchtitan`` (FSDP ZeRO 3, the nearest plan3d
profile to Composer's FSDP FULL_SHARD), tp 1, pp 1, dp = the GPUs, the row's micro-batch, global batch and sequence,
full recompute where the row checkpoints activations, bf16 (fp8 for the FP8 rows), FlashAttention-2's speed, no
compile; its model is MPT's
(``models`` and ``model_note``: plan3d's parameter count equals the row's NumParams). Error = predicted tokens/s per
GPU / published - 1 (positive: plan3d is optimistic). ``--scorer`` also predicts each run as
``../shared/tools/score_runs.py`` scores a run (a few minutes): the stated knobs pinned (tp 1, pp 1, cp 1, the
micro-batch, the recompute), plan3d's defaults for the rest (``--framework megatron``, its default attention kernel)
and the search's pick, a run it finds no plan for counted as a miss. Prints, per table and overall, the mean |error| and the worst signed error, by
run size (one 8-GPU node or more) and by activation checkpointing; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.cost import estimate_time  # noqa: E402
from planner.memory import estimate_memory  # noqa: E402
from planner.presets import load_hardware  # noqa: E402
from planner.specs import ModelSpec, Plan, TrainingSpec, plan_problems  # noqa: E402
from planner.candidates import Pins, SearchSpace, switch_options  # noqa: E402
from planner.search import search  # noqa: E402

DATA = ROOT / "benchmarks/data/llm_foundry_mpt.json"
VOCAB = 50368  # every MPT yaml's vocab_size (model_note)


def parse_row(line: str) -> dict:
    """One verbatim table row as a dict of the fields used here (the file's ``columns``)."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 20:
        raise ValueError(f"expected 20 cells, got {len(cells)}: {line}")
    return {"model": cells[0], "seq": int(cells[1]), "gpus": int(cells[2]), "gpu": cells[3], "mfu": float(cells[4]),
            "mbs": int(cells[7]), "ga": int(cells[8]), "gbs": int(cells[9]), "tokens_per_s_per_gpu": int(cells[12]),
            "precision": cells[14], "mp_mode": cells[15], "sharding": cells[16], "act_ckpt": cells[17] == "True",
            "cpu_offload": cells[18] == "True", "num_params": int(cells[19])}


def mpt_model(size: str, arch: dict, seq: int) -> ModelSpec:
    """MPT as the benchmark built it (``model_note``): GELU MLP of 4 d, LayerNorm, biases, learned positions of
    the run's sequence, tied output layer."""
    d = arch["d_model"]
    return ModelSpec(name=f"mpt-{size}", num_layers=arch["n_layers"], hidden_size=d, num_attention_heads=arch["n_heads"],
                     ffn_hidden_size=4 * d, vocab_size=VOCAB, max_seq_len=seq, activation="gelu", norm="layernorm",
                     tied_embeddings=True, position_embedding="learned", linear_bias=True)


def precision_of(row: dict) -> str:
    """plan3d's precision for the row's: fp8 for Composer's amp_fp8 (Transformer Engine's FP8 linears), else bf16."""
    return "fp8" if row["precision"] == "amp_fp8" else "bf16"


def job(row: dict, arch: dict) -> tuple[ModelSpec, TrainingSpec, Plan]:
    """The run pinned as it ran (module docstring)."""
    model = mpt_model(row["model"], arch, row["seq"])
    training = TrainingSpec(num_gpus=row["gpus"], global_batch_size=row["gbs"], seq_len=row["seq"],
                            precision=precision_of(row), framework="torchtitan", attention="flash2", compile=False)
    plan = Plan(tp=1, pp=1, dp=row["gpus"], cp=1, micro_batch_size=row["mbs"],
                recompute="full" if row["act_ckpt"] else "none", zero_stage=3)
    return model, training, plan


def predict(row: dict, arch: dict, hw) -> dict:
    model, training, plan = job(row, arch)
    out = {"params_match": model.num_params == row["num_params"]}
    problems = plan_problems(model, hw, training, plan)
    if problems:
        return out | {"refused": "; ".join(problems)}
    est = estimate_time(model, hw, training, plan)
    mem = estimate_memory(model, hw, training, plan)
    predicted = est.tokens_per_s / row["gpus"]
    return out | {"predicted": predicted, "error": predicted / row["tokens_per_s_per_gpu"] - 1,
                  "peak_gib": mem.peak_gib, "usable_gib": mem.usable_gib, "fits": mem.fits, "mfu": est.mfu}


def scorer_error(row: dict, arch: dict, hw) -> float | None:
    """Predicted / published tokens/s per GPU - 1 as the scorer predicts the run (module docstring), None for a miss."""
    model = mpt_model(row["model"], arch, row["seq"])
    training = TrainingSpec(num_gpus=row["gpus"], global_batch_size=row["gbs"], seq_len=row["seq"],
                            precision=precision_of(row))
    pins = Pins(tp=1, pp=1, cp=1, micro_batch_size=row["mbs"], recompute="full" if row["act_ckpt"] else "none")
    res = search(model, hw, training, SearchSpace(pins=pins, **switch_options(training)))
    if res.best is None:
        return None
    est = estimate_time(model, hw, res.training, res.best)
    return est.tokens_per_s / row["gpus"] / row["tokens_per_s_per_gpu"] - 1


def summary(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label:<40} no runs"
    worst = max(errors, key=abs)
    return (f"{label:<40} {len(errors):3d} runs  mean |error| {100 * sum(map(abs, errors)) / len(errors):5.1f} %  "
            f"worst {100 * worst:+6.1f} %  mean signed {100 * sum(errors) / len(errors):+5.1f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every run")
    parser.add_argument("--scorer", action="store_true", help="also predict each run as the scorer does (minutes)")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    everything: list[float] = []
    scored: dict[str, list[float]] = {}
    misses: list[str] = []
    refused = not_fitting = 0
    for name, table in data["tables"].items():
        hw = load_hardware(table["hardware"])
        groups: dict[str, list[float]] = {"all": [], "8 GPUs": [], "16-128 GPUs": [], "activation checkpointing": [],
                                          "no activation checkpointing": []}
        print(f"== {table['title']} ({table['hardware']})")
        for line in table["rows_markdown"]:
            row = parse_row(line)
            res = predict(row, data["models"][row["model"]], hw)
            tag = (f"{row['model']:>5} seq {row['seq']:>6} {row['gpus']:>3} GPUs mbs {row['mbs']:>3} ga {row['ga']:>2} "
                   f"AC {'yes' if row['act_ckpt'] else 'no ':3} {row['mp_mode']:<7}")
            if "refused" in res:
                refused += 1
                print(f"  {tag} refused: {res['refused']}")
                continue
            not_fitting += not res["fits"]
            err = res["error"]
            groups["all"].append(err)
            groups["8 GPUs" if row["gpus"] == 8 else "16-128 GPUs"].append(err)
            groups["activation checkpointing" if row["act_ckpt"] else "no activation checkpointing"].append(err)
            if args.rows or not res["fits"]:
                print(f"  {tag} published {row['tokens_per_s_per_gpu']:>7} tokens/s/GPU, predicted "
                      f"{res['predicted']:>9.0f} ({100 * err:+6.1f} %), peak {res['peak_gib']:5.1f} of "
                      f"{res['usable_gib']:.1f} GiB{'' if res['fits'] else ' (does NOT fit: it ran)'}")
            if args.scorer:
                e = scorer_error(row, data["models"][row["model"]], hw)
                if e is None:
                    misses.append(f"{table['title'][:10]} {tag}")
                else:
                    scored.setdefault(name, []).append(e)
        for label, errs in groups.items():
            print("  " + summary(label, errs))
        if args.scorer:
            print("  " + summary("as the scorer predicts it", scored.get(name, [])))
        everything += groups["all"]
    print(summary("overall", everything))
    if args.scorer:
        print(summary("overall, as the scorer predicts it", [e for errs in scored.values() for e in errs]))
        print(f"{len(misses)} runs the scorer's way finds no plan for (misses):")
        for line in misses:
            print(f"  {line}")
    print(f"{refused} runs refused; {not_fitting} runs that ran predicted not to fit under the torchtitan profile, whose "
          "memory is torchtitan's code, not Composer's (its fp32 loss path, where Composer's MPT uses flash-attn's fused "
          "cross-entropy, among it): not a test of the memory model (docs/cost-model.md, \"llm-foundry's MPT runs\")")


if __name__ == "__main__":
    main()
