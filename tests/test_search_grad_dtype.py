"""Job switches the search chooses (search.SWITCHES): the gradient dtype (candidates.grad_dtype_options), fp8
weights (candidates.fp8_params_options) and Transformer Engine's fused cross entropy
(candidates.cross_entropy_fusion_options).

Megatron-LM keeps fp32 main gradients unless told ``--grad-reduce-in-bf16`` and bf16 weights unless told
``--fp8-param-gather``; NVIDIA's published runs set both (NeMo-Framework-Launcher
examples/training/gpt/h100/175b_fp8_16node.sh: ``+training.model.optim.grad_sync_dtype=bf16``; Megatron-Bridge's fp8
and mxfp8 recipes: ``fp8_param_gather = True``). `plan3d search` searches both values where the user set neither.
"""

import json

import numpy as np
import pytest

from planner.candidates import (Pins, SearchSpace, cross_entropy_fusion_options, fp8_params_options,
                                grad_dtype_options, switch_options)
from planner.cli import app
from planner.memory import estimate_memory
from planner.presets import load_hardware, load_model
from planner.search import build_tables, exhaustive_with_training, search
from planner.specs import ModelSpec, Plan, TrainingSpec
from tests.table_checks import assert_entry_is_estimate, legal_keys

H100 = load_hardware("h100-sxm-80gb")
BOTH = (False, True)

# NeMo 24.07 performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md, commit 070a0bb1,
# Pretraining table, DGX-H100, FP8; copied in benchmarks/data/nemo_h100_fp8_2407.json): GPT3-175B on 512 GPUs,
# TP4 PP8 VP6 MBS2 GBS2048, seq 2048, ran (782 tokens/s/GPU). The architecture is GPT-3 175B's (Brown et al. 2020).
GPT3_175B = ModelSpec(name="gpt3-175b-nemo", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      ffn_hidden_size=4 * 12288, vocab_size=51200, activation="gelu", norm="layernorm",
                      position_embedding="learned", max_seq_len=2048, tied_embeddings=True, linear_bias=True)
NEMO_175B_JOB = TrainingSpec(num_gpus=512, global_batch_size=2048, seq_len=2048, precision="fp8")
NEMO_175B_PINS = Pins(tp=4, pp=8, vpp=6, cp=1, micro_batch_size=2)


def assert_lighter_switch(model, hw, off: TrainingSpec, on: TrainingSpec, pp: int) -> None:
    """The tables of ``on`` (a switch at its lighter value) against ``off`` (at its default): the same legal entries,
    none slower, none larger on any stage, and some smaller."""
    space = SearchSpace(max_micro_batch_size=2, max_cp=2, pins=Pins(pp=pp))
    t0, t1 = build_tables(model, hw, off, space), build_tables(model, hw, on, space)
    legal = t0.legal
    assert (legal == t1.legal).all()
    assert (t1.time_ns[legal] <= t0.time_ns[legal]).all()
    assert (t1.mem_kib[legal] <= t0.mem_kib[legal]).all()
    assert (t1.mem_kib[legal] < t0.mem_kib[legal]).any()


def test_options_only_where_unset_mixed_precision_and_emitted():
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096)
    assert grad_dtype_options(tr, None) == BOTH
    assert grad_dtype_options(tr.model_copy(update={"framework": "nemo"}), None) == BOTH
    assert grad_dtype_options(tr, False) is None and grad_dtype_options(tr, True) is None  # the user's word
    assert grad_dtype_options(tr.model_copy(update={"precision": "fp32"}), None) is None  # no 16-bit grads
    # plan3d's torchtitan and DeepSpeed files carry no gradient-dtype setting
    assert grad_dtype_options(tr.model_copy(update={"framework": "torchtitan"}), None) is None
    assert grad_dtype_options(tr.model_copy(update={"framework": "deepspeed"}), None) is None


def test_switch_options_are_the_search_space_keywords_of_both_switches():
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096, precision="fp8")
    assert switch_options(tr) == {"grad_reduce_in_bf16": BOTH, "fp8_params": BOTH,
                                  "cross_entropy_fusion": ("none", "te")}
    assert switch_options(tr, False, True, "none") == {"grad_reduce_in_bf16": None, "fp8_params": None,
                                                       "cross_entropy_fusion": None}
    assert SearchSpace(**switch_options(tr)).fp8_params == BOTH


def test_fused_loss_offered_only_where_unset_and_run():
    """Megatron's and NeMo's jobs without --cross-entropy-fusion; not where the user gave one, nor in frameworks
    without Megatron's loss kernels (specs.job_problems refuses them there)."""
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096)
    assert cross_entropy_fusion_options(tr, None) == ("none", "te")
    assert cross_entropy_fusion_options(tr.model_copy(update={"framework": "nemo"}), None) == ("none", "te")
    for given in ("none", "native", "te"):
        assert cross_entropy_fusion_options(tr, given) is None
    for framework in ("torchtitan", "deepspeed"):
        assert cross_entropy_fusion_options(tr.model_copy(update={"framework": framework}), None) is None


@pytest.mark.parametrize("pp", [1, 2])
def test_the_fused_loss_is_never_slower_nor_larger(pp):
    """What search.search relies on for the loss kernel (search.SWITCHES): no combination is slower, needs more memory
    on any stage or changes legality with Transformer Engine's fused cross entropy, and the loss stage's are smaller
    (2 B per logit, not 6)."""
    model = load_model("llama3-8b")
    off = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    on = off.model_copy(update={"cross_entropy_fusion": "te"})
    assert_lighter_switch(model, H100, off, on, pp)


def test_search_takes_the_fused_loss_only_where_a_plan_needs_it():
    """MosaicML's MPT-760M at 12 x 2,048 tokens on 8 A100 40GB without recompute (llm-foundry's benchmark README,
    benchmarks/data/llm_foundry_mpt.json: it ran) fits only with the fused loss under Megatron's semantics (37.7 GiB
    of 36.0 unfused at ZeRO 3, 33.0 fused): the search finds it with --cross-entropy-fusion te, which brute force
    over both kernels agrees with and the plan file carries; where the unfused loss fits (micro-batch 4), the search
    keeps Megatron's default."""
    model = ModelSpec(name="mpt-760m", num_layers=24, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=6144,
                      vocab_size=50368, max_seq_len=2048, activation="gelu", norm="layernorm", tied_embeddings=True,
                      position_embedding="learned", linear_bias=True)
    a100 = load_hardware("a100-40gb")
    tr = TrainingSpec(num_gpus=8, global_batch_size=384, seq_len=2048)
    pins = Pins(tp=1, pp=1, cp=1, micro_batch_size=12, recompute="none")
    assert search(model, a100, tr, SearchSpace(pins=pins)).best is None  # the job's own (unfused) loss only
    space = SearchSpace(pins=pins, **switch_options(tr))
    res = search(model, a100, tr, space)
    assert res.best is not None and res.training.cross_entropy_fusion == "te"
    assert estimate_memory(model, a100, res.training, res.best).fits
    assert not estimate_memory(model, a100, tr, res.best).fits
    _, _, _, brute_tr = exhaustive_with_training(model, a100, tr, space)
    assert brute_tr.cross_entropy_fusion == "te"
    lighter = search(model, a100, tr, SearchSpace(pins=Pins(tp=1, pp=1, cp=1, micro_batch_size=4, recompute="none"),
                                                  **switch_options(tr)))
    assert lighter.best is not None and lighter.training.cross_entropy_fusion == "none"


def test_fp8_params_offered_only_where_lighter_and_emitted():
    tr = TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096, precision="fp8")
    assert fp8_params_options(tr, None) == BOTH
    assert fp8_params_options(tr.model_copy(update={"precision": "mxfp8"}), None) == BOTH
    assert fp8_params_options(tr, True) is None and fp8_params_options(tr, False) is None  # the user's word
    for other in ({"precision": "bf16"}, {"precision": "nvfp4"}, {"framework": "torchtitan"},
                  # NeMo 1's bf16 Apex optimizer adds a bf16 master copy with fp8 weights: not lighter there
                  {"framework": "nemo", "optimizer_dtype": "bf16-apex"}):
        assert fp8_params_options(tr.model_copy(update=other), None) is None, other


@pytest.mark.parametrize("model_name,hw_name,precision,framework,pp", [
    ("llama3-8b", "h100-sxm-80gb", "fp8", "megatron", 1), ("llama3-8b", "h100-sxm-80gb", "fp8", "nemo", 2),
    ("llama3-8b", "b200-180gb", "mxfp8", "megatron", 2), ("mixtral-8x7b", "h100-sxm-80gb", "fp8", "megatron", 2)])
def test_fp8_params_are_never_slower_nor_larger(model_name, hw_name, precision, framework, pp):
    """What search.search relies on for fp8 weights (search.SWITCHES): no combination is slower, needs
    more memory on any stage or changes legality with them, and some are smaller."""
    model = load_model(model_name)
    hw = load_hardware(hw_name).model_copy(update={"inter_node_bandwidth_gbps": 5.0})
    off = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096, precision=precision, framework=framework)
    on = off.model_copy(update={"fp8_params": True})
    assert_lighter_switch(model, hw, off, on, pp)


def test_search_takes_fp8_params_only_where_they_help():
    """fp8 weights are taken where faster (fp8 all-gathers over a slow network) and match brute force; a ZeRO-0
    plan (nothing gathered; Megatron's --fp8-param-gather needs the distributed optimizer) keeps bf16 weights."""
    model = load_model("llama3-8b")
    hw = H100.model_copy(update={"inter_node_bandwidth_gbps": 5.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096, precision="fp8")
    space = SearchSpace(max_micro_batch_size=2, max_cp=1, zero_stages=(1,), pins=Pins(pp=1), fp8_params=BOTH)
    res = search(model, hw, tr, space)
    _, brute_t, _, brute_tr = exhaustive_with_training(model, hw, tr, space)
    from planner.cost import estimate_time

    assert estimate_time(model, hw, res.training, res.best).step_time_s == pytest.approx(brute_t, rel=1e-9)
    assert res.training.fp8_params and brute_tr.fp8_params
    zero0 = search(model, hw, tr, SearchSpace(max_micro_batch_size=2, max_cp=1, zero_stages=(0,), pins=Pins(pp=1),
                                              fp8_params=BOTH))
    assert zero0.best.zero_stage == 0 and zero0.training.fp8_params is False


@pytest.mark.parametrize("pp", [1, 2])
def test_bf16_grads_are_never_slower_nor_larger(pp):
    """What planner.search.search relies on to build its tables under bf16 gradients only: every combination is
    no slower and needs no more memory on any stage with bf16 gradients than with fp32 ones, except at the optimizer
    step without the distributed optimizer (search.LARGER_AT_STEP_WHEN_TRUE: Megatron's fp32 copies of the bf16
    gradients, 4 B per parameter, against the 2 B the bf16 buffer saves, where the stage's activations are smaller);
    and the bf16 tables are estimate_time / stage_memory of their plans."""
    model = load_model("llama3-8b")
    hw = H100.model_copy(update={"inter_node_bandwidth_gbps": 5.0})  # slow DP: the dtypes' times differ
    fp32 = TrainingSpec(num_gpus=16, global_batch_size=64, seq_len=4096)
    bf16 = fp32.model_copy(update={"grad_reduce_in_bf16": True})
    space = SearchSpace(max_micro_batch_size=2, pins=Pins(pp=pp))
    t32, t16 = build_tables(model, hw, fp32, space), build_tables(model, hw, bf16, space)
    legal = t32.legal
    assert (legal == t16.legal).all()
    assert (t16.time_ns[legal] <= t32.time_ns[legal]).all()
    # the step's fp32 copies bind only where nothing shards them: ZeRO 0, or one data-parallel rank (dp x cp = 1)
    zero = np.broadcast_to(np.array(t16.zeros)[None, None, :], legal.shape)
    shards = np.broadcast_to(np.array([dp * cp for _, cp, dp, *_ in t16.shapes])[:, None, None], legal.shape)
    unsharded = (zero == 0) | (shards == 1)
    larger = legal & (t16.mem_kib > t32.mem_kib).any(axis=-1)
    assert larger.any() and unsharded[larger].all()
    assert (t16.mem_kib[legal & ~unsharded] <= t32.mem_kib[legal & ~unsharded]).all()
    assert (t16.time_ns[legal] < t32.time_ns[legal]).any() and (t16.mem_kib[legal] < t32.mem_kib[legal]).any()
    keys = legal_keys(t16)
    for k in keys[:: max(1, len(keys) // 15)]:
        assert_entry_is_estimate(model, hw, bf16, t16, k)


def test_search_matches_brute_force_and_names_its_dtype():
    model = load_model("llama3-8b")
    hw = H100.model_copy(update={"inter_node_bandwidth_gbps": 5.0})
    tr = TrainingSpec(num_gpus=16, global_batch_size=32, seq_len=4096)
    space = SearchSpace(max_micro_batch_size=2, max_cp=1, zero_stages=(0, 1), pins=Pins(pp=1),
                        grad_reduce_in_bf16=BOTH)
    res = search(model, hw, tr, space)
    brute, brute_t, _, brute_tr = exhaustive_with_training(model, hw, tr, space)
    from planner.cost import estimate_time

    assert estimate_time(model, hw, res.training, res.best).step_time_s == pytest.approx(brute_t, rel=1e-9)
    # DP over a 5 GB/s network: halving the gradient bytes is faster, and both searches say so
    assert res.training.grad_reduce_in_bf16 and brute_tr.grad_reduce_in_bf16


def test_ties_keep_fp32_gradients():
    """One replica (dp = cp = 1): no gradient is reduced, so the dtypes tie on time and fp32 is kept."""
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096)
    res = search(model, H100, tr, SearchSpace(pins=Pins(tp=8, cp=1), grad_reduce_in_bf16=BOTH))
    assert res.best.dp == 1
    assert res.training.grad_reduce_in_bf16 is False


def test_nemo_175b_layout_fits_at_zero1_only_with_bf16_grads():
    """The published layout at ZeRO-1 (Megatron's distributed optimizer, as NeMo ran it) with selective
    recompute does not fit with fp32 gradients and does with bf16 ones. The search keeps ZeRO-1 either way;
    with fp32 gradients only full recompute fits (about a third slower than the measured 10.48 s step)."""
    plan = Plan(tp=4, pp=8, dp=16, vpp=6, micro_batch_size=2, sequence_parallel=True, recompute="selective",
                zero_stage=1)
    fp32 = estimate_memory(GPT3_175B, H100, NEMO_175B_JOB, plan)
    bf16 = estimate_memory(GPT3_175B, H100, NEMO_175B_JOB.model_copy(update={"grad_reduce_in_bf16": True}), plan)
    # hand count: stage 0 holds 12 layers of 12 h^2 (+ 13 h) / tp4 parameters (+ the embedding); the gradient
    # buffer is 4 B per parameter against 2 B, so it halves exactly
    assert bf16.stages[0].grads_bytes * 2 == fp32.stages[0].grads_bytes
    assert not fp32.fits and bf16.fits
    searched = search(GPT3_175B, H100, NEMO_175B_JOB, SearchSpace(pins=NEMO_175B_PINS, grad_reduce_in_bf16=BOTH))
    assert searched.training.grad_reduce_in_bf16 and searched.best.recompute != "full"
    fp32_only = search(GPT3_175B, H100, NEMO_175B_JOB, SearchSpace(pins=NEMO_175B_PINS))
    assert not fp32_only.training.grad_reduce_in_bf16 and fp32_only.best.recompute == "full"


def _search_json(runner, *extra):
    res = runner.invoke(app, ["search", "--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--gpus", "64",
                              "--global-batch", "128", "--seq-len", "8192", "--top", "2", "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cli_searches_the_dtype_unless_told(runner):
    free = _search_json(runner)
    assert free["training"]["grad_reduce_in_bf16"] is True  # DP over InfiniBand: bf16 halves the reduction
    fp32 = _search_json(runner, "--no-grad-reduce-in-bf16")
    assert fp32["training"]["grad_reduce_in_bf16"] is False
    assert all(a["training"]["grad_reduce_in_bf16"] is False for a in fp32["alternatives"])
    assert fp32["time"]["step_time_s"] >= free["time"]["step_time_s"]
    tt = _search_json(runner, "--framework", "torchtitan")
    assert tt["training"]["grad_reduce_in_bf16"] is False


def test_cli_searches_fp8_params_in_fp8_jobs(runner, tmp_path):
    free = _search_json(runner, "--precision", "fp8")
    assert free["training"]["fp8_params"] is True and free["plan"]["zero_stage"] >= 1
    assert _search_json(runner, "--precision", "fp8", "--no-fp8-params")["training"]["fp8_params"] is False
    assert _search_json(runner)["training"]["fp8_params"] is False  # bf16: not offered
    res = runner.invoke(app, ["search", "--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--gpus", "64",
                              "--global-batch", "128", "--seq-len", "8192", "--precision", "fp8", "--top", "0",
                              "--emit", "megatron", "--out-dir", str(tmp_path), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "fp8 params" in res.output
    assert "--fp8-param-gather" in "".join(p.read_text() for p in tmp_path.glob("*.megatron.args"))


def test_emitted_megatron_launch_carries_the_picked_dtype(runner, tmp_path):
    res = runner.invoke(app, ["search", "--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--gpus", "64",
                              "--global-batch", "128", "--seq-len", "8192", "--top", "0", "--emit", "megatron",
                              "--out-dir", str(tmp_path), "--out", str(tmp_path / "plan.json"), "--quiet"])
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["training"]["grad_reduce_in_bf16"] is True
    text = "".join(p.read_text() for p in tmp_path.glob("*.megatron.args"))
    assert "--grad-reduce-in-bf16" in text


def test_fp32_gradients_are_searched_where_only_they_fit():
    """One GPU, full recompute: Megatron's optimizer step copies a bf16 gradient buffer to fp32 (4 B per parameter,
    frameworks.megatron.step_grad_copy_bytes) while fp32 gradients are stepped on in place, so on a GPU between the
    two peaks only fp32 gradients fit. The search, which builds its tables with bf16 gradients, searches again with
    fp32 ones (search.LARGER_AT_STEP_WHEN_TRUE) and names them; without that it found no plan."""
    model = load_model("llama2-7b")
    tr = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=2048)
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1, recompute="full", zero_stage=1)
    peak = {bf: estimate_memory(model, H100, tr.model_copy(update={"grad_reduce_in_bf16": bf}), plan).peak_gib
            for bf in (False, True)}
    assert peak[True] - peak[False] == pytest.approx(2 * model.num_params / 2**30 - 0.9, abs=0.5)  # 4 B - 2 B - acts
    usable = (peak[False] + peak[True]) / 2
    hw = H100.model_copy(update={"gpu_memory_gib": (usable + H100.cuda_context_gib + H100.nccl_buffers_gib)
                                 / (1 - H100.fragmentation_headroom)})
    pins = Pins(tp=1, pp=1, micro_batch_size=1, recompute="full")
    space = SearchSpace(pins=pins, zero_stages=(0, 1), grad_reduce_in_bf16=BOTH)  # Megatron's own optimizer
    res = search(model, hw, tr, space)
    assert res.best is not None and res.training.grad_reduce_in_bf16 is False
    assert estimate_memory(model, hw, res.training, res.best).fits
    bf16 = tr.model_copy(update={"grad_reduce_in_bf16": True})
    assert search(model, hw, bf16, SearchSpace(pins=pins, zero_stages=(0, 1))).best is None
