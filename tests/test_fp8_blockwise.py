"""FP8 block scaling (``fp8_recipe: blockwise``): Transformer Engine's Float8BlockScaling as Megatron-Core runs it
(``--fp8-recipe blockwise``; Megatron-Bridge ``bf16_with_fp8_subchannel_scaling_mixed``; DeepSeek-V3's recipe).

Hand-computed values: the quantisation cost from Transformer Engine's own GEMM benchmark on an H200 NVL
(docs/examples/gemm_profiling/gemm_profiling.rst, commit 8f2e635: per layer of the 5B config, FP8Block 22.882 ms in
autocast, FP8Current's kernels alone 16.785 ms), the saved GEMM inputs' scales from the recipe's 1 x 128 tiles of
FP32 scales.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.cost import LOW_PRECISION_CAST_BYTES, _fp8_cast_bytes_per_token, estimate_time
from planner.memory import layer_activation_terms
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, job_problems

H100 = load_hardware("h100-sxm-80gb")
# elements the benchmark quantises per layer: M x (the 4 linears' inputs + their output gradients) + the weights
_E = 15872 * (4096 + 4096 + 4096 + 16384 + 12288 + 4096 + 16384 + 4096) + (4096 * 12288 + 4096 * 4096 + 2 * 4096 * 16384)
_H200_HBM_BYTES_PER_S = 4800e9 * 0.8  # H200 NVL datasheet 4.8 TB/s at the profiles' hbm_efficiency 0.8


def _job(**kw) -> TrainingSpec:
    return TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096, precision="fp8", **kw)


def test_block_scaling_cast_bytes_are_te_benchmarks_autocast_gap():
    blockwise = (22.882 - 16.785) * 1e-3 * _H200_HBM_BYTES_PER_S / _E  # 18.86 B per element
    assert LOW_PRECISION_CAST_BYTES["fp8_blockwise"] == pytest.approx(blockwise)
    assert blockwise == pytest.approx(18.86, abs=0.01)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1)
    fwd, bwd = _fp8_cast_bytes_per_token(load_model("llama3-8b"), plan, [(4096, 14336, "fc1")], "fp8", "blockwise")
    assert (fwd, bwd) == (pytest.approx(blockwise * 4096), pytest.approx(blockwise * 14336))


def test_step_time_orders_the_recipes_as_te_measures_them_on_hopper():
    """TE's H200 per-layer autocast times: delayed 18.978 < current 20.285 < block 22.882 ms; the same plan's step
    follows that order (current and block scaling's steps differ in the casts and, by the scales, in the SP
    all-gathers' bytes)."""
    model = load_model("llama3-8b")
    plan = Plan(tp=2, pp=1, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    t = {r: estimate_time(model, H100, _job(fp8_recipe=r), plan).step_time_s
         for r in ("delayed", "tensorwise", "blockwise")}
    assert t["delayed"] < t["tensorwise"] < t["blockwise"], t


def test_saved_gemm_inputs_carry_one_fp32_scale_per_128_values():
    """Llama-3-8B, TP 2 with SP, micro-batch 1, 4,096 tokens: the four GEMM inputs a layer saves (QKV and FC1 inputs
    h/t each, out-projection input q/t, FC2 input f/t) each gain 4 B per 128 values over per-tensor fp8."""
    model = load_model("llama3-8b")
    plan = Plan(tp=2, pp=1, dp=4, micro_batch_size=1, sequence_parallel=True)
    saved = {r: sum(x.bytes for x in layer_activation_terms(model, _job(fp8_recipe=r), plan))
             for r in ("tensorwise", "blockwise")}
    elements = 4096 * (4096 + 4096 + 4096 + 14336) / 2
    assert saved["blockwise"] - saved["tensorwise"] == pytest.approx(elements * 4 / 128)


def test_block_scaling_is_megatrons():
    model = load_model("llama3-8b")
    assert job_problems(model, H100, _job(fp8_recipe="blockwise")) == []
    assert job_problems(model, H100, _job(fp8_recipe="blockwise", framework="nemo")) == []
    (torchtitan,) = job_problems(model, H100, _job(fp8_recipe="blockwise", framework="torchtitan"))
    assert "framework megatron or nemo" in torchtitan
    # Megatron-LM's own functional test gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph trains it on GB200
    assert job_problems(model, load_hardware("gb200-nvl72"), _job(fp8_recipe="blockwise")) == []


def test_on_blackwell_block_scaling_runs_mxfp8_kernels_and_keeps_both_weight_directions():
    """TE emulates FP8 block scaling through MXFP8 on Blackwell: the GEMMs at MXFP8's measured rate (B300: 0.95x
    per-tensor FP8's kernels), and the column-wise weight copy is its own quantisation, not a transpose that
    Blackwell's any-layout FP8 GEMMs let per-tensor fp8 drop: 1 B more per GEMM weight than tensorwise there."""
    from planner.cost import Rates, gemm_precision
    from planner.frameworks.megatron import linear_params_per_rank
    from planner.memory import estimate_memory

    b200, model = load_hardware("b200-180gb"), load_model("llama3-8b")
    blockwise, tensorwise = _job(fp8_recipe="blockwise"), _job(fp8_recipe="tensorwise")
    assert (gemm_precision(blockwise, b200), gemm_precision(tensorwise, b200)) == ("mxfp8", "fp8")
    assert gemm_precision(blockwise, H100) == "fp8"
    assert Rates.of(b200, "mxfp8").gemm_flops == pytest.approx(Rates.of(b200, "fp8").gemm_flops * 6.812 / 7.161)
    plan = Plan(tp=2, pp=1, dp=4, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    weights = {r: estimate_memory(model, b200, _job(fp8_recipe=r), plan).stages[0].weights_bytes
               for r in ("tensorwise", "blockwise")}
    assert weights["blockwise"] - weights["tensorwise"] == pytest.approx(linear_params_per_rank(model, 2, 32))
    on_h100 = {r: estimate_memory(model, H100, _job(fp8_recipe=r), plan).stages[0].weights_bytes
               for r in ("tensorwise", "blockwise")}
    assert on_h100["blockwise"] == on_h100["tensorwise"]  # Hopper keeps the fp8 transpose of per-tensor fp8 too
    t = {r: estimate_time(model, b200, _job(fp8_recipe=r), plan).step_time_s for r in ("tensorwise", "blockwise")}
    assert t["blockwise"] > t["tensorwise"]


def test_cli_takes_the_recipe_and_names_it_in_the_error(tmp_path):
    runner = CliRunner()
    job = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "16",
           "--seq-len", "4096", "--precision", "fp8", "--tp", "2", "--pp", "1", "--sequence-parallel",
           "--zero-stage", "1"]
    ok = runner.invoke(app, ["estimate", *job, "--fp8-recipe", "blockwise", "--json"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["estimate", *job, "--fp8-recipe", "subchannel"])
    assert bad.exit_code == 2
    assert "--fp8-recipe: 'subchannel' is not one of delayed, tensorwise, blockwise" in bad.output
    emitted = runner.invoke(app, ["search", *job, "--fp8-recipe", "blockwise", "--emit", "megatron",
                                  "--out-dir", str(tmp_path)])
    assert emitted.exit_code == 0, emitted.output
    (args,) = tmp_path.glob("*.megatron.args")
    assert "--fp8-recipe blockwise" in args.read_text()
