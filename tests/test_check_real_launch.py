"""`plan3d check` on real public launch files (tests/data/launch/real, copied verbatim; README.md there
names each file's repository, path and commit, its license, and how every figure below follows from
the file and the framework's rules). The figures are worked out by hand, never copied from plan3d.
"""

from pathlib import Path

import pytest

from planner.check import check_file_branches, exit_code
from planner.cli import app
from planner.memory import estimate_scenario_memory
from planner.presets import load_hardware

REAL = Path(__file__).parent / "data" / "launch" / "real"
H100 = "h100-sxm-80gb"

# (file, extra options, exit code, one-line error text or {figure: value})
CASES = [
    # NVIDIA/Megatron-LM: --rampup-batch-size with --train-iters, which validate_args asserts against
    ("megatron_lm_train_gpt3_175b_distributed.sh", {}, 2, "--rampup-batch-size with --train-iters"),
    ("megatron_lm_train_gpt3_175b_distributed.sh", {"gpus": 128}, 2, "--rampup-batch-size with --train-iters"),
    ("megatron_lm_train_gpt3_857m_distributed.sh", {}, 0,
     {"tp": 8, "pp": 1, "dp": 1, "micro_batch_size": 8, "global_batch_size": 128, "num_microbatches": 16,
      "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 4096,
      "vocab_size": 50257, "precision": "bf16", "zero_stage": 0, "recompute": "none",
      "sequence_parallel": False, "attention": "flash", "position_embedding": "learned"}),
    ("megatron_lm_train_mixtral_8x7b_distributed.sh", {}, 0,
     {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "micro_batch_size": 1, "global_batch_size": 4, "num_microbatches": 2,
      "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 896, "num_attention_heads": 2, "num_kv_heads": 2,
      "num_experts": 2, "top_k": 2, "moe_ffn_hidden_size": None, "vocab_size": 32000, "precision": "fp32",
      "zero_stage": 1, "sequence_parallel": False, "norm": "rmsnorm", "tied_embeddings": False}),
    ("megatron_lm_train_deepseek2_lite_h100_fp8.sh", {}, 0,
     {"tp": 8, "pp": 1, "dp": 1, "ep": 1, "sequence_parallel": True, "micro_batch_size": 1, "global_batch_size": 64,
      "num_microbatches": 64, "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "head_dim": None,
      "ffn_hidden_size": 10944, "num_experts": 64, "top_k": 6, "moe_ffn_hidden_size": 1408,
      "shared_expert_ffn_hidden_size": 2816, "first_k_dense": 1, "q_lora_rank": None, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 153600,
      "precision": "bf16", "zero_stage": 1, "grad_reduce_in_bf16": True, "tied_embeddings": False}),
    # on H100 80GB this one is within a few GiB of the limit (no bound either way): checked on H200 141GB
    ("megatron_lm_train_llama3_8b_h100_fp8.sh", {"hardware": "h200-141gb"}, 0,
     {"tp": 1, "pp": 1, "cp": 1, "dp": 8, "micro_batch_size": 1, "global_batch_size": 128, "num_microbatches": 16,
      "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_kv_heads": 8, "vocab_size": 128257,
      "precision": "fp8", "zero_stage": 1, "sequence_parallel": False, "recompute": "none",
      "grad_reduce_in_bf16": True, "fp8_params": True}),
    ("megatron_lm_train_bert_340m_distributed.sh", {}, 2, "pretrain_bert.py trains a BERT encoder"),
    ("megatron_lm_train_t5_220m_distributed.sh", {}, 2, "pretrain_t5.py trains a T5 encoder-decoder"),
    ("rocm_megatron_lm_train_mixtral_8x7B_slurm.sh", {}, 2, "no training launch found"),
    ("rocm_megatron_lm_train_llama2.sh", {}, 2, "more than 32 combinations of if/case branches"),
    ("megatron_deepspeed_run_llama_bf16.sh", {}, 2, "add --vocab-size N"),
    ("megatron_deepspeed_run_llama_bf16.sh", {"vocab_size": 32000}, 0,
     {"tp": 2, "pp": 2, "dp": 2, "micro_batch_size": 4, "global_batch_size": 32, "num_microbatches": 4,
      "num_layers": 24, "hidden_size": 2048, "ffn_hidden_size": 5504, "num_attention_heads": 16,
      "num_kv_heads": None, "vocab_size": 32000, "precision": "bf16", "zero_stage": 1, "fp16": False,
      "recompute": "none", "attention": "materialized", "norm": "rmsnorm", "position_embedding": "rope", "activation": "swiglu",
      "tied_embeddings": False}),
    ("megatron_deepspeed_ds_pretrain_gpt_350M_dense.sh", {}, 2, "deepspeed without --num_gpus"),
    ("megatron_deepspeed_ds_pretrain_gpt_350M_dense.sh", {"gpus": 8}, 2,
     "the DeepSpeed config ds_config_gpt_gpt-0.35B-lr-3.0e-4-minlr-3.0e-5-bs-256-gpus-8-mp-1-pp-1.json"),
    ("megatron_deepspeed_ds_pretrain_gpt_125M_flashattn.sh", {}, 2,
     "the DeepSpeed config ds_config_gbs256_mbs2_log100_zero1.json is neither written"),
    ("bigscience_tr11-176B-ml.slurm", {}, 0,
     {"tp": 4, "pp": 12, "dp": 8, "micro_batch_size": 2, "global_batch_size": 2048, "num_microbatches": 128,
      "num_layers": 70, "hidden_size": 14336, "num_attention_heads": 112, "ffn_hidden_size": 57344,
      "vocab_size": 250880, "precision": "bf16", "zero_stage": 0, "framework": "deepspeed", "fp16": False,
      "recompute": "full",
      "position_embedding": "alibi", "embedding_norm": True, "tied_embeddings": True,
      "layers_per_stage": (5,) + (6,) * 10 + (5,)}),
    ("torchtitan_llama3_70b.toml", {}, 2, "pass --gpus"),
    ("torchtitan_llama3_70b.toml", {"gpus": 64}, 0,
     {"tp": 8, "pp": 1, "dp": 8, "micro_batch_size": 8, "global_batch_size": 64, "zero_stage": 3,
      "recompute": "full", "num_layers": 80, "hidden_size": 8192, "vocab_size": 128256, "precision": "bf16"}),
    ("torchtitan_llama3_8b.toml", {"gpus": 64}, 0,
     {"tp": 1, "pp": 1, "dp": 64, "micro_batch_size": 1, "global_batch_size": 64, "zero_stage": 3,
      "recompute": "selective", "num_layers": 32, "vocab_size": 128256, "precision": "bf16"}),
    ("torchtitan_llama3_405b.toml", {"gpus": 128}, 0,
     {"tp": 8, "pp": 1, "dp": 16, "micro_batch_size": 2, "global_batch_size": 32, "zero_stage": 3,
      "recompute": "full", "num_layers": 126, "hidden_size": 16384, "precision": "fp8", "sequence_parallel": True}),
    ("torchtitan_deepseek_v3_16b.toml", {"gpus": 8}, 2, "mixture-of-experts model with no plan3d preset"),
    ("torchtitan_deepseek_v3_671b.toml", {"gpus": 256}, 1,
     {"tp": 1, "pp": 1, "dp": 256, "ep": 1, "micro_batch_size": 4, "global_batch_size": 1024, "zero_stage": 3,
      "recompute": "selective", "num_layers": 61, "hidden_size": 7168, "num_experts": 256, "top_k": 8,
      "vocab_size": 129280, "fits": False}),
]


def _figures(result) -> dict:
    sc = result.scenario
    out = sc.resolved_plan().model_dump() | sc.model.model_dump() | sc.training.model_dump()
    out["fits"] = estimate_scenario_memory(sc).fits
    return out


def _id(case) -> str:
    name, extra = case[0], case[1]
    return name + ("[" + ",".join(f"{k}={v}" for k, v in extra.items()) + "]" if extra else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_real_launch_file(case):
    name, extra, code, want = case
    results = check_file_branches(REAL / name, load_hardware(extra.get("hardware", H100)), None, extra.get("gpus"),
                                  extra.get("vocab_size"))
    assert exit_code(results) == code, [(r.branch, r.errors) for r in results]
    if code == 2:
        assert len(results) == 1 and want in results[0].errors[0], results[0].errors
        assert "\n" not in results[0].errors[0]
        return
    assert len(results) == 1, [r.branch for r in results]
    figures = _figures(results[0])
    assert {k: figures[k] for k in want} == want


def test_every_real_file_has_a_case():
    assert {p.name for p in REAL.iterdir() if p.name != "README.md"} == {c[0] for c in CASES}


def test_bf16_at_zero_stage_0_is_deepspeeds_bf16_optimizer():
    """BLOOM's bf16 + ZeRO stage 0 is DeepSpeed's BF16_Optimizer (bf16_optimizer.py), judged by the deepspeed
    profile: fp32 master and Adam sharded over dp = 8, full fp32 gradients and the bf16 ones next to them, which
    it zeroes but keeps (clear_lp_grads; pipe/engine.py calls it before each backward of a stage that is not the
    last). A middle stage holds 6 layers of 12 h^2 / tp 4 = 3.70e9 parameters (h = 14336): 12 B x 3.70e9 / 8 =
    5.55e9 B of optimizer states (whole: 44.4e9) and (2 + 4) B x 3.70e9 of gradients. Read with Megatron's
    profile before, the 2 B of bf16 gradients (7.4e9 B here) went uncounted."""
    (r,) = check_file_branches(REAL / "bigscience_tr11-176B-ml.slurm", load_hardware(H100), None, None, None)
    assert r.scenario.training.framework == "deepspeed"
    assert any("BF16_Optimizer" in n for n in r.notes), r.notes
    middle = estimate_scenario_memory(r.scenario).stages[5]
    params = 6 * 12 * 14336 ** 2 / 4
    assert middle.optimizer_bytes == pytest.approx(12 * params / 8, rel=0.01)
    assert middle.grads_bytes == pytest.approx(6 * params, rel=0.01)


def test_gpu_count_error_names_the_fix():
    (r,) = check_file_branches(REAL / "megatron_lm_train_gpt3_857m_distributed.sh", load_hardware(H100), None, 12,
                               None)
    assert "12 GPUs are not divisible by tp(8)" in r.errors[0] and "pass --gpus N" in r.errors[0], r.errors


@pytest.mark.parametrize("name,code", [("megatron_lm_train_t5_220m_distributed.sh", 2),
                                       ("bigscience_tr11-176B-ml.slurm", 0),
                                       ("rocm_megatron_lm_train_llama2.sh", 2)])
def test_cli_exit_codes_without_traceback(runner, name, code):
    res = runner.invoke(app, ["check", str(REAL / name), "--hardware", H100])
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output


def test_torchtitan_tomls_are_judged_by_the_torchtitan_profile():
    """A torchtitan TOML is read with the torchtitan profile, the one checked against torchtitan's published
    readings (tests/test_framework_memory.py): its eager unfused SwiGLU, op-level selective AC and reserved
    memory, not plan3d validate's own model. torchtitan's llama3_70b.toml at 64 GPUs (TP 8, FSDP 8, full AC,
    local batch 8) is judged at more than the validate model says: reading it with the latter would have
    under-predicted."""
    (r,) = check_file_branches(REAL / "torchtitan_llama3_70b.toml", load_hardware(H100), None, 64, None)
    assert r.scenario.training.framework == "torchtitan"
    as_validate = r.scenario.model_copy(update={"training": r.scenario.training.model_copy(update={"framework": "torch"})})
    assert estimate_scenario_memory(r.scenario).peak_gib > estimate_scenario_memory(as_validate).peak_gib


@pytest.mark.parametrize("edit, layers, method", [
    # no --pp-partition-method: Megatron-DeepSpeed's GPTModelPipe falls back to type:transformer
    (lambda t: t.replace("    --pp-partition-method 'type:transformer|embedding' \\\n", ""), 70, "type:transformer"),
    # 71 layers + 2 embeddings = 73 slots do not split evenly over 12: DeepSpeed's partition_balanced decides
    (lambda t: t.replace("NLAYERS=70", "NLAYERS=71"), 71, "type:transformer|embedding"),
])
def test_megatron_deepspeed_stages_are_deepspeeds_partition(tmp_path, edit, layers, method):
    """A Megatron-DeepSpeed launch gets the stages DeepSpeed's PipelineModule builds for its partition method
    (planner.frameworks.deepspeed.pipeline_partitions, compared with DeepSpeed's own partition_balanced in
    tests/test_framework_memory.py), also where they are uneven; before, 70 layers on 12 stages without the
    BLOOM method, or 73 slots with it, were refused."""
    from planner.frameworks.deepspeed import pipeline_partitions

    text = (REAL / "bigscience_tr11-176B-ml.slurm").read_text()
    changed = edit(text)
    assert changed != text
    path = tmp_path / "tr11.slurm"
    path.write_text(changed)
    (r,) = check_file_branches(path, load_hardware(H100), None, None, None)
    assert not r.errors, r.errors
    assert r.scenario.plan.layers_per_stage == pipeline_partitions(layers, 12)[method]
    assert r.scenario.model.num_layers == layers
