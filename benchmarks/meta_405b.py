"""Meta's Llama 3 405B layout (issue 14): predicted against published throughput, memory, and the search.

Run: python benchmarks/meta_405b.py

Data: benchmarks/data/llama3_405b_meta.json (Dubey et al. 2024, arXiv:2407.21783, Table 4 and section
3.3.2). Every setting is the paper's where it states one, quoted in the data file's ``stated``:

* 126 layers as 7 + 14 x 8 + 7 on 16 pipeline ranks, **vpp 8**: "we reduce one Transformer layer each from
  the first and the last stages, respectively. This means that the first model chunk on the first stage has
  only the embedding, and the last model chunk on the last stage has only output projection and loss
  calculation" (section 3.3.2). Taking one layer off a stage empties its first chunk only when a chunk holds
  one layer: 8 layers per middle stage in chunks of 1, V = 8 (Plan.chunk_layers: (0, 1 x 7) on rank 0,
  (1 x 7, 0) on rank 15). vpp 2 or 4 leave 3 or 1 layers in that chunk, against the quote.
* **ZeRO-2**: "Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model shards we
  do not reshard after forward computation" (section 3.3.2): sharded optimizer and gradients, bf16 weights
  whole through forward and backward; fp32 gradients ("we use FP32 gradient accumulation during backward
  computation over multiple micro-batches and also reduce-scatter gradients in FP32", ibid., Numerical
  stability).
* **No recompute**: "we could pre-train Llama 3 on sequences of 8K tokens without activation
  checkpointing" (ibid.).
* Table 4's batch per DP rank: 32 sequences of 8,192 tokens at 8,192 GPUs, 16 at 16,384.

Not stated, and varied or assumed here: micro-batch size 1 (32 and 16 micro-batches per step, the most
the batch allows; a larger one holds more activations per micro-batch in flight); the micro-batch group
N ("Our key insight is to make N tunable", Figure 6), every N Megatron-Core's interleaved schedule
accepts (``interleaved_problems``: pp <= N <= m, the last group full or >= pp), N = 16 the fewest
activations; sequence parallelism on (the paper cites Korthikanti et al. 2023 for TP); the framework is
Megatron-Core's (the paper's is Meta's own).

For each run and N it prints the predicted TFLOP/s per GPU against the published one, the peak memory
against usable, the per-term memory of the first, second, a middle and the last stage (transformer layers'
activations with the layer-micro-batches in flight), and the best plan the search finds for the same job
with its gain over Meta's. It asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.estimate import estimate  # noqa: E402
from planner.memory import GIB, output_bytes, pipeline_buffer_bytes, saved_bytes_per_layer_kind  # noqa: E402
from planner.memory import stage_saved_bytes  # noqa: E402
from planner.presets import load_hardware, load_model  # noqa: E402
from planner.schedules import interleaved_problems  # noqa: E402
from planner.search import search  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402


def meta_plan(run: dict, layout: dict, group: int | None = None) -> Plan:
    """Meta's plan for one Table 4 row with the settings section 3.3.2 states (module docstring)."""
    return Plan(tp=run["tp"], pp=run["pp"], dp=run["dp"], cp=run["cp"], vpp=layout["vpp"],
                micro_batch_size=layout["micro_batch_size"],
                sequence_parallel=True, zero_stage=layout["zero_stage"], recompute=layout["recompute"],
                layers_per_stage=tuple(layout["layers_per_stage"]), microbatch_group_size=group)


def group_sizes(plan: Plan, m: int) -> list[int]:
    """Every N Megatron-Core's interleaved schedule runs for ``m`` micro-batches (``interleaved_problems``)."""
    return [n for n in range(plan.pp, m + 1) if not interleaved_problems(plan.pp, plan.vpp, m, n)]


def breakdown(sc: Scenario, est, m: int, stages: tuple[int, ...]) -> list[str]:
    """Per-term GiB of the given stages; 'in flight' is the transformer layers' saved activations over one
    layer's (layer-micro-batches held at the stage's peak)."""
    layer_b, _ = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)
    out = []
    for r in stages:
        st = est.memory.stages[r]
        saved = stage_saved_bytes(sc.model, sc.training, sc.plan, m, r, st.layers)
        p2p = float(pipeline_buffer_bytes(sc.model, sc.training, sc.plan, m, r))
        logits = output_bytes(sc.model, sc.training, sc.plan) if r == sc.plan.loss_stage else 0.0
        out.append(f"    stage {r:2d} ({st.layers} layers): weights {st.weights_bytes / GIB:5.2f}, grads "
                   f"{st.grads_bytes / GIB:5.2f}, optimizer {st.optimizer_bytes / GIB:5.2f}, activations "
                   f"{st.activations_bytes / GIB:5.2f} ({saved / layer_b:.0f} layer-micro-batches in flight x "
                   f"{layer_b / GIB:.3f}), other {st.other_bytes / GIB:4.2f} (P2P buffers {p2p / GIB:.2f}, "
                   f"output layer and loss {logits / GIB:.2f}); total {st.total_bytes / GIB:5.1f} GiB")
    return out


def main() -> None:
    data = json.loads((ROOT / "benchmarks/data/llama3_405b_meta.json").read_text())
    model, hw = load_model(data["model"]), load_hardware(data["hardware"])
    layout = data["stated"]
    for run in data["runs"]:
        training = TrainingSpec(num_gpus=run["gpus"], global_batch_size=run["global_batch"], seq_len=run["seq"])
        best = search(model, hw, training).best
        best_est = estimate(Scenario(model=model, hardware=hw, training=training, plan=best)) if best else None
        base = meta_plan(run, layout)
        m = run["global_batch"] // (base.micro_batch_size * run["dp"])
        print(f"== {run['gpus']} GPUs, TP {run['tp']} PP {run['pp']} DP {run['dp']}, {m} micro-batches per "
              f"DP rank: published {run['tflops_per_gpu']} TFLOP/s per GPU")
        for n in group_sizes(base, m):
            plan = meta_plan(run, layout, n)
            sc = Scenario(model=model, hardware=hw, training=training, plan=plan)
            est = estimate(sc)
            t = est.time.tflops_per_gpu
            gain = (best_est.time.tokens_per_s / est.time.tokens_per_s - 1) if best_est else float("nan")
            print(f"  vpp {plan.vpp} N {n} ZeRO-{plan.zero_stage}: predicted {t:6.0f} TFLOP/s "
                  f"({100 * (t / run['tflops_per_gpu'] - 1):+5.1f} %), peak {est.memory.peak_gib:6.1f} of "
                  f"{est.memory.usable_gib:.1f} GiB on stage {est.memory.peak.stage} "
                  f"({'fits' if est.memory.fits else 'does NOT fit'}); search's best over it {100 * gain:+.1f} %")
            print("\n".join(breakdown(sc, est, m, (0, 1, plan.pp // 2, plan.pp - 1))))
        if best_est:
            print(f"  search's best: {best.label()} (recompute {best.recompute}, ZeRO-{best.zero_stage}), "
                  f"{best_est.time.tflops_per_gpu:.0f} TFLOP/s, peak {best_est.memory.peak_gib:.1f} GiB")


if __name__ == "__main__":
    main()
