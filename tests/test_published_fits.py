"""Published configurations that ran must be predicted to fit (issue 13), and an obvious misfit must not.

Each case states the settings read from the configuration that ran, with its source. The memory
terms they switch are cited in planner/frameworks/megatron.py; the expected outcome ("fits") is the
published fact that the job ran on its GPUs, not a number computed by the code under test.
"""

import json
from pathlib import Path

from planner.memory import estimate_memory
from planner.presets import load_hardware
from planner.specs import ModelSpec, Plan, TrainingSpec, job_problems

H100 = load_hardware("h100-sxm-80gb")
DATA = json.loads((Path(__file__).parent / "data" / "published_memory.json").read_text())
NEMOTRON = DATA["nemotron4_340b_nemo_2407"]
# architecture: tests/data/published_memory.json (NeMo-Framework-Launcher conf/training/nemotron/
# nemotron_340b.yaml, arXiv:2406.11704 Table 1); squared-ReLU is a two-matrix MLP (modelled as gelu)
NEMOTRON_340B = ModelSpec(name="nemotron4-340b", **NEMOTRON["model"])

# NVIDIA/dgxc-benchmarking nemotron/ (GSW 25.01 on NeMo 24.09), the recipe NVIDIA publishes for this
# model at exactly this layout: configure.sh, MODEL_SIZE=340b: TP=8 PP=8 VP=12 MBS=1,
# GBS = 2 x nodes (= 32 on the 16 nodes of 128 GPUs), model.fp8=True model.fp8_hybrid=True
# model.sequence_parallel=True and "+model.fp8_params=${FP8_ENABLED^}" (True for the fp8 run);
# nemotron4-340b-synth.yaml: activations_checkpoint_granularity: selective, optim
# distributed_fused_adam (Apex DistributedFusedAdam) with grad_sync_dtype: bf16 (its gradient buckets
# in bf16) and dtype: bf16 (its Adam states in bf16: NeMo 1's Apex optimizer, optimizer_dtype bf16-apex;
# planner/frameworks/nemo.py).
NEMOTRON_RECIPE = dict(precision="fp8", fp8_params=True, grad_reduce_in_bf16=True, optimizer_dtype="bf16-apex",
                       framework="nemo")
NEMOTRON_PLAN = Plan(tp=8, pp=8, dp=2, vpp=12, micro_batch_size=1, sequence_parallel=True, zero_stage=1,
                     recompute="selective")


def _nemotron_training(**kw):
    return TrainingSpec(num_gpus=kw.pop("num_gpus", 128), global_batch_size=32, seq_len=4096,
                        **{**NEMOTRON_RECIPE, **kw})


def test_nemotron4_340b_nemo_fp8_recipe_fits():
    """NeMo performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md, NeMo
    24.07, DGX-H100): Nemotron-340B, 128 GPUs, TP8 PP8 VP12 MBS1 GBS32, seq 4096, FP8 ran, at
    678 TFLOP/s per GPU. With the recipe's settings above it must fit on one 80 GB H100."""
    tr = _nemotron_training()
    assert job_problems(NEMOTRON_340B, H100, tr) == []
    est = estimate_memory(NEMOTRON_340B, H100, tr, NEMOTRON_PLAN)
    assert est.fits, f"{est.peak_gib:.2f} GiB > usable {est.usable_gib:.2f}"


def test_nemotron4_340b_without_pipeline_cannot_fit():
    """The same model on TP8 x DP16 without a pipeline: each GPU holds 1/8 of 341B parameters, over
    42B, whose fp8 weights and transposes (2 B each) and bf16 gradients (2 B) alone pass 80 GB."""
    tr = _nemotron_training()
    est = estimate_memory(NEMOTRON_340B, H100, tr, Plan(tp=8, pp=1, dp=16, micro_batch_size=1,
                                                        sequence_parallel=True, zero_stage=1,
                                                        recompute="selective"))
    assert not est.fits


def test_fp8_params_are_refused_where_not_modelled():
    """fp8 parameters need fp8 training (Megatron --fp8-param-gather asserts an fp8 recipe) and exist
    only in the Megatron-Core profiles."""
    bf16 = _nemotron_training(precision="bf16")
    assert job_problems(NEMOTRON_340B, H100, bf16) == [
        "fp8_params: fp8 weights need precision fp8 or mxfp8 (Megatron --fp8-param-gather), not bf16; "
        "set precision fp8 or drop fp8_params"]
    # (the recipe's bf16 gradient reduction, which torchtitan does not run, is its own problem: test_check_torchtitan_fsdp)
    tt = _nemotron_training(framework="torchtitan", optimizer_dtype="fp32", grad_reduce_in_bf16=False)
    assert job_problems(NEMOTRON_340B, H100, tt) == [
        "fp8_params: torchtitan as plan3d models it keeps bf16 weights; drop fp8_params"]

