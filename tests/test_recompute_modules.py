"""Megatron's selective recompute of chosen modules (``--recompute-modules``; TrainingSpec.recompute_modules):
what each drops from memory (planner.memory.apply_recompute_modules), what it costs again
(planner.cost.module_recompute_s), the job problems Megatron raises, the emitted flag through Megatron's own
parser and config, and `plan3d check` reading it back."""

from __future__ import annotations

import pytest

from planner import cost, memory
from planner.check import check_file
from planner.emit import render_all
from planner.io import write_all
from planner.presets import load_hardware, load_model
from planner.specs import Plan, TrainingSpec, job_problems
from tests.test_emit_consumers import megatron, megatron_validate, scenario  # noqa: F401  (megatron: fixture)

H100 = load_hardware("h100-sxm-80gb")
S = 4096


def _saved(model, modules, plan=None, moe=None, **job):
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=S, recompute_modules=modules, **job)
    plan = plan or Plan(tp=1, pp=1, dp=8, micro_batch_size=1, recompute="selective")
    return memory.saved_bytes_per_layer(memory.layer_activation_terms(model, tr, plan, moe=moe), "selective")


def test_mla_up_proj_drops_the_up_projections_by_hand():
    """DeepSeek-V3 at tp 1, bf16, 4096 tokens: mla_up_proj discards per token the q-norm rstd (4 B), the normalised
    q latent (1536 x 2 B), the kv-norm rstd (4 B), the normalised kv latent (512 x 2 B), Q and K (128 heads x 192 x
    2 B each) and V (128 x 128 x 2 B): 135,176 B, 553,680,896 B per layer."""
    model = load_model("deepseek-v3")
    drop = _saved(model, ("core_attn",), moe=False) - _saved(model, ("core_attn", "mla_up_proj"), moe=False)
    assert drop == 4096 * (4 + 1536 * 2 + 4 + 512 * 2 + 2 * 128 * 192 * 2 + 128 * 128 * 2) == 553_680_896


def test_a_list_without_core_attn_keeps_the_attention_core():
    """Megatron's default is core_attn; a list without it (DeepSeek-V3's recipe: mla_up_proj, mlp) keeps the
    flash kernel's fp32 log-sum-exp, 128 heads x 4 B per token."""
    model = load_model("deepseek-v3")
    kept = _saved(model, ("mla_up_proj",), moe=False) - _saved(model, ("mla_up_proj", "core_attn"), moe=False)
    assert kept == 4096 * 128 * 4


def test_mlp_drops_a_dense_layers_mlp_by_hand():
    """Llama-3-8B at tp 1, bf16: the MLP checkpoint (its fused pre-MLP norm inside) keeps its input and drops the
    rstd (4 B), FC1's input (4096 x 2 B), the SwiGLU input (2 x 14336 x 2 B) and FC2's input (14336 x 2 B) per
    token; a MoE layer's MLP is not touched by mlp (Megatron: recompute_mlp only when not is_moe_layer)."""
    model = load_model("llama3-8b")
    drop = _saved(model, ("core_attn",)) - _saved(model, ("core_attn", "mlp"))
    assert drop == 4096 * (4 + 4096 * 2 + 2 * 14336 * 2 + 14336 * 2)
    moe = load_model("tiny-moe")
    assert _saved(moe, ("core_attn",), moe=True) == _saved(moe, ("core_attn", "mlp"), moe=True)


def test_moe_modules():
    """moe keeps of the MoE part only its input; moe_act drops the experts' FC2 input; shared_experts the shared
    expert's two tensors."""
    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=1024, recompute_modules=("moe",))
    plan = Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1, recompute="selective")
    terms = memory.layer_activation_terms(model, tr, plan, moe=True)
    moe_names = {x.name for x in memory.moe_activation_terms(model, tr, plan)}
    kept = {x.name for x in terms if memory.kept_under(x, "selective")} & moe_names
    assert kept == {"MoE input (pre-MLP norm output; router and shared-expert FC1 save it)"}
    for mods, gone in ((("moe_act",), {"expert FC2 input"}),
                       (("shared_experts",), {"shared-expert activation input (FC1 output)", "shared-expert FC2 input"})):
        tr2 = tr.model_copy(update={"recompute_modules": mods})
        dropped = {x.name for x in memory.layer_activation_terms(model, tr2, plan, moe=True)
                   if not memory.kept_under(x, "selective")}
        assert dropped & moe_names == gone


def test_recompute_time_adds_what_each_module_runs_again():
    """The recomputed forward grows by the q/kv up-projection GEMMs with mla_up_proj, and the dispatch and combine
    run again in backward with moe."""
    model = load_model("deepseek-v3")
    plan = Plan(tp=1, pp=16, dp=128, ep=64, micro_batch_size=1, recompute="selective",
                layers_per_stage=(3,) + (4,) * 14 + (2,))
    tr = TrainingSpec(num_gpus=2048, global_batch_size=4096, seq_len=S)
    base = cost.layer_time(model, H100, tr, plan, moe=True)
    up = cost.layer_time(model, H100, tr.model_copy(update={"recompute_modules": ("core_attn", "mla_up_proj")}),
                         plan, moe=True)
    rates = cost.Rates.of(H100, "bf16")
    shapes = cost._linear_shapes(model, plan, True)
    gemms = sum(cost.gemm_fwd_bwd_s(S, *shapes[n][:2], rates)[0] for n in ("q_up", "kv_up"))
    assert up.recompute - base.recompute == pytest.approx(gemms)
    whole = cost.layer_time(model, H100, tr.model_copy(update={"recompute_modules": ("moe",)}), plan, moe=True)
    assert whole.ep_bwd > base.ep_bwd and whole.recompute > up.recompute - base.recompute


def test_job_problems_megatron_raises():
    llama, dsv3 = load_model("llama3-8b"), load_model("deepseek-v3")
    tr = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=S)
    assert any("mla_up_proj needs multi-latent attention" in x
               for x in job_problems(llama, H100, tr.model_copy(update={"recompute_modules": ("mla_up_proj",)})))
    assert any("torchtitan has no per-module selective recompute" in x for x in job_problems(
        dsv3, H100, tr.model_copy(update={"recompute_modules": ("mla_up_proj",), "framework": "torchtitan"})))
    fp8 = tr.model_copy(update={"precision": "fp8", "recompute_modules": ("moe_act",)})
    assert any("delayed scaling" in x for x in job_problems(dsv3, H100, fp8))
    assert not job_problems(dsv3, H100, fp8.model_copy(update={"fp8_recipe": "tensorwise"}))


def test_megatron_runs_the_emitted_recompute_modules_and_check_reads_them(megatron, monkeypatch, tmp_path):
    """DeepSeek-V3's H100 recipe list (mla_up_proj, mlp) reaches Megatron's parser, validate_args and
    TransformerConfig as written, and `plan3d check` reads the script back with the same modules."""
    from tests.test_emit_moe import DSV3_STAGES, _args_file_argv, _grouped_gemm_capability

    sc = scenario(model="deepseek-v3", gpus=2048, global_batch=4096, seq_len=4096, tp=1, pp=16, dp=128, ep=64,
                  zero_stage=1, recompute="selective", layers_per_stage=DSV3_STAGES)
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"recompute_modules": ("mla_up_proj", "mlp")})})
    _grouped_gemm_capability(monkeypatch, 9)
    _, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["mla_up_proj", "mlp"]
    scripts = [p for p in write_all(tmp_path / "sh", render_all(sc, ["torchrun"])) if p.suffix == ".sh"]
    result = check_file(scripts[0], H100, None, None)
    assert not result.errors, result.errors
    assert result.scenario.training.recompute_modules == ("mla_up_proj", "mlp")


def test_default_modules_are_not_written(tmp_path):
    sc = scenario(model="llama3-8b", gpus=8, global_batch=8, seq_len=4096, tp=1, pp=1, dp=8, recompute="selective")
    text = "\n".join(render_all(sc, ["megatron"]).values())
    assert "--recompute-granularity selective" in text and "--recompute-modules" not in text


def test_search_tables_price_the_modules():
    """A search under recompute_modules holds in each table entry the estimate of its plan (time and memory),
    selective entries included."""
    from planner.candidates import SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model = load_model("tiny-moe")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024,
                      recompute_modules=("mlp", "moe_act", "shared_experts"))
    tables = build_tables(model, H100, tr, SearchSpace(max_micro_batch_size=2))
    keys = [k for k in legal_keys(tables) if tables.plan(k).recompute == "selective"]
    assert len(keys) > 10
    for k in keys[:: max(1, len(keys) // 30)]:
        assert_entry_is_estimate(model, H100, tr, tables, k)


def test_cli_takes_the_modules_and_refuses_bad_ones(runner):
    """`--recompute-modules` reaches the estimate (less memory with mlp than Megatron's default) and a bad name or a
    module Megatron refuses for the model exits 2 with the field named."""
    import json

    from planner.cli import app
    from tests.test_cli import _bad

    job = ["estimate", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "8",
           "--seq-len", "4096", "--tp", "1", "--pp", "1", "--recompute", "selective", "--json"]
    peaks = []
    for extra in ([], ["--recompute-modules", "core_attn,mlp"]):
        res = runner.invoke(app, job + extra)
        assert res.exit_code in (0, 1), res.output  # 1: does not fit, the JSON printed all the same
        peaks.append(json.loads(res.output)["memory"]["peak_gib"])
    assert peaks[1] < peaks[0]
    _bad(runner, job + ["--recompute-modules", "attention"], "--recompute-modules: 'attention' is not one of")
    _bad(runner, job + ["--recompute-modules", "mla_up_proj"], "recompute_modules: mla_up_proj needs multi-latent")


def test_an_empty_module_list_writes_no_recompute(tmp_path):
    """Selective recompute of no module recomputes nothing: no --recompute-granularity (Megatron would apply its
    default core_attn), and no empty --recompute-modules (its argparse takes one value or more)."""
    sc = scenario(model="llama3-8b", gpus=8, global_batch=8, seq_len=4096, tp=1, pp=1, dp=8, recompute="selective")
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"recompute_modules": ()})})
    text = "\n".join(render_all(sc, ["megatron"]).values())
    assert "--recompute-granularity" not in text and "--recompute-modules" not in text
    base = memory.saved_bytes_per_layer(memory.layer_activation_terms(sc.model, sc.training, sc.plan), "selective")
    none = memory.saved_bytes_per_layer(memory.layer_activation_terms(sc.model, sc.training, sc.plan), "none")
    assert base == none
