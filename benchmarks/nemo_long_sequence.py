"""NeMo's long-sequence sweep (LLAMA2-7B FP8 on DGX-H100, 4K to 1M tokens, CP 1-32) against plan3d (issue 12).

Run: python benchmarks/nemo_long_sequence.py

Data: benchmarks/data/nemo_long_sequence_h100.json (NeMo Framework 24.12 user guide, "Long Sequence Performance",
with its source and what it leaves out). The page gives model TFLOP/s per GPU; the step time is rebuilt with the
formula NeMo counted them with (``nemo_flops``: attention counted in full, no causal halving). Each row's layout
(TP, PP, DP, CP, micro-batch 1) is pinned and costed by ``planner.cost.estimate_time`` through ``plan3d search``
(which also takes the job switches the page does not state). The page does not say whether the runs recomputed
anything, so each row is printed three ways: recompute left to the search (what a user without the flag gets),
Megatron's selective recompute (the attention core) and full recompute. The global batch is not stated either:
4M tokens per step is assumed (the same page's B200 table), and the figures are also printed at 1M and 16M
tokens to show they do not depend on it. The column "causal" is the step time had NeMo halved the causal
attention FLOPs (its later formula), for reference. Nothing was fitted to these rows; it asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.candidates import Pins, SearchSpace  # noqa: E402
from planner.cost import estimate_time  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.search import search  # noqa: E402
from planner.specs import TrainingSpec  # noqa: E402

DATA = ROOT / "benchmarks/data/nemo_long_sequence_h100.json"
LLAMA2_VOCAB = 32000  # NeMo's LLM_VOCAB_SIZE_MAP["llama2"]
TOKENS_PER_STEP = 4 * 2**20  # assumed (module docstring)


def nemo_flops(model, gbs: int, seq: int, causal: bool = False) -> float:
    """Model FLOPs of one step as NeMo's ``flops_formulas.llama2`` counts them (the data file's ``flops_formula``):
    ``gbs*s*L*h^2*(12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h))``; ``causal`` halves the ``12 s/h`` attention term,
    as NeMo's later formula does."""
    h, L = model.hidden_size, model.num_layers
    attention = 12 * seq / h * (0.5 if causal else 1.0)
    return gbs * seq * L * h * h * (12 + 12 * model.kv_heads / model.num_attention_heads
                                    + 18 * model.ffn_hidden_size / h + attention + 6 * LLAMA2_VOCAB / (L * h))


def predicted_s(model, hw, precision: str, row: dict, gbs: int, recompute: str | None):
    """plan3d's step time for the row's pinned layout (``recompute`` None: the search's pick), and the plan."""
    training = TrainingSpec(num_gpus=row["gpus"], global_batch_size=gbs, seq_len=row["seq_k"] * 1024,
                            precision=precision)
    pins = Pins(tp=row["tp"], pp=row["pp"], cp=row["cp"], micro_batch_size=1, recompute=recompute)
    best = search(model, hw, training, SearchSpace(pins=pins)).best
    if best is None:
        return None, None
    return estimate_time(model, hw, training, best).step_time_s, best


def main() -> None:
    data = json.loads(DATA.read_text())
    # the sweep runs past the preset's 4K context (the page extends it; the estimate needs no position table)
    model = load_model(data["model"]).model_copy(update={"max_seq_len": None})
    hw = load_hardware(data["hardware"])
    print(f"{'seq':>6s} {'GPUs':>5s} layout          measured s  causal s | predicted s and error: "
          f"{'search':>16s} {'selective':>16s} {'full':>16s}  search picks")
    errors = {"search": [], "selective": [], "full": []}
    for row in data["rows"]:
        seq = row["seq_k"] * 1024
        gbs = max(TOKENS_PER_STEP // seq, row["dp"])
        measured = nemo_flops(model, gbs, seq) / (row["tflops_per_gpu"] * 1e12 * row["gpus"])
        causal = nemo_flops(model, gbs, seq, causal=True) / (row["tflops_per_gpu"] * 1e12 * row["gpus"])
        cells, pick = [], None
        for name, rc in (("search", None), ("selective", "selective"), ("full", "full")):
            t, plan = predicted_s(model, hw, data["precision"], row, gbs, rc)
            if t is None:
                cells.append(f"{'no plan':>16s}")
                continue
            errors[name].append((row, t / measured - 1))
            cells.append(f"{t:8.2f} {100 * (t / measured - 1):+6.1f}%")
            pick = pick or plan
        layout = f"TP{row['tp']} PP{row['pp']} DP{row['dp']} CP{row['cp']}"
        print(f"{row['seq_k']:5d}K {row['gpus']:5d} {layout:15s} {measured:10.2f} {causal:9.2f} | "
              f"{' '.join(cells)}  recompute {pick.recompute if pick else '-'}")
    for name, pairs in errors.items():
        if pairs:
            errs = [e for _, e in pairs]
            long = [e for r, e in pairs if r["seq_k"] >= 32] or [float("nan")]
            print(f"{name:9s}: mean |error| {100 * sum(map(abs, errs)) / len(errs):5.1f} %, worst "
                  f"{100 * max(errs, key=abs):+6.1f} %; from 32K: mean {100 * sum(long) / len(long):+6.1f} %")
    print("batch (tokens per step) does not matter: step-time error of the search's pick at")
    for tokens in (2**20, 16 * 2**20):
        errs = []
        for row in data["rows"]:
            seq = row["seq_k"] * 1024
            gbs = max(tokens // seq, row["dp"])
            t, _ = predicted_s(model, hw, data["precision"], row, gbs, None)
            errs.append(100 * (t / (nemo_flops(model, gbs, seq) / (row["tflops_per_gpu"] * 1e12 * row["gpus"])) - 1))
        print(f"  {tokens / 2**20:4.0f}M tokens: " + " ".join(f"{e:+6.1f}%" for e in errs))


if __name__ == "__main__":
    main()
