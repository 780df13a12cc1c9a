"""Published Megatron-LM runs as scenarios, for the golden cost-model test and benchmarks/published_runs.py.

The records (tests/data/calibration_runs.json) come from Narayanan et al. 2021 (arXiv:2104.04473)
Tables 1-2 and Korthikanti et al. 2022 (arXiv:2205.05198) Table 5, all on DGX A100 80GB (Selene).
Where a publication leaves a setting out, the assumption is stated here and in
docs/cost-model.md:

* Narayanan 2021 Table 1 gives no micro-batch size: **1** is assumed (Table 2 uses 1 for the
  same models). It gives no interleaving degree either: the **non-interleaved** 1F1B schedule
  is assumed.
* 2021 and 2022 Megatron-LM: fp16/bf16 mixed precision with fused, **materialised** attention
  (no FlashAttention), dropout 0.1, and **no** ``--overlap-grad-reduce`` (added in 2023). The
  2021 fp16 runs keep and all-reduce 16-bit gradients; the 2022 runs (bf16) use fp32 main grads.
* Narayanan 2021 reports TFLOP/s per GPU, counted with its own formula (eq. 3, full recompute,
  non-causal attention: ``planner.flops.narayanan_flops_per_step``). The published iteration
  time is that count / (TFLOP/s x GPUs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner import flops
from planner.presets import load_hardware
from planner.specs import ModelSpec, Plan, Scenario, TrainingSpec

TIME_FAMILIES = ("Narayanan2021_Table1", "Narayanan2021_Table2", "Korthikanti2022_Table3_5")


@dataclass(frozen=True)
class PublishedRun:
    name: str
    family: str
    source: str
    scenario: Scenario
    published_time_s: float
    how: str  # how the published time was obtained


def load_runs(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())


def _model(run: dict) -> ModelSpec:
    return ModelSpec(name=f"gpt-{run['model_params_billion']}b", num_layers=run["num_layers"],
                     hidden_size=run["hidden_size"], num_attention_heads=run["num_attention_heads"],
                     ffn_hidden_size=run["ffn_hidden_size"], vocab_size=run["vocab_size"],
                     max_seq_len=run["seq_length"], activation="gelu", norm="layernorm", tied_embeddings=True,
                     position_embedding="learned", linear_bias=True, dropout=True)


def _recompute(run: dict) -> str:
    return "selective" if str(run["activation_recompute"]).startswith("selective") else "full"


def to_published(run: dict) -> PublishedRun | None:
    """The run as a scenario with its published iteration time, or None if it has neither time nor TFLOP/s."""
    if run["family"] not in TIME_FAMILIES:
        return None
    model = _model(run)
    narayanan = run["family"].startswith("Narayanan")
    training = TrainingSpec(num_gpus=run["num_gpus"], global_batch_size=run["global_batch_size"],
                            seq_len=run["seq_length"], attention="materialized", overlap_grad_reduce=False,
                            grad_reduce_in_bf16=narayanan)
    plan = Plan(tp=run["tp"], pp=run["pp"], dp=run["dp"], vpp=run["vp"] or 1,
                micro_batch_size=run["micro_batch_size"] or 1, recompute=_recompute(run),
                sequence_parallel=bool(run["sequence_parallel"]))
    scenario = Scenario(model=model, hardware=load_hardware("a100-80gb"), training=training, plan=plan)
    if run.get("iteration_time_s"):
        time_s, how = run["iteration_time_s"], "iteration time as published"
    else:
        f = flops.narayanan_flops_per_step(model, run["global_batch_size"], run["seq_length"])
        time_s = f / (run["tflops_per_gpu"] * 1e12 * run["num_gpus"])
        how = f"eq. 3 FLOPs / ({run['tflops_per_gpu']} TFLOP/s x {run['num_gpus']} GPUs)"
    return PublishedRun(name=run["name"], family=run["family"], source=run["source"], scenario=scenario,
                        published_time_s=time_s, how=how)


def published_runs(path: str | Path) -> list[PublishedRun]:
    return [p for p in (to_published(r) for r in load_runs(path)) if p is not None]
