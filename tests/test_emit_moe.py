"""Launch files for mixture-of-experts and MLA plans, run through their consumers' own checks.

* Megatron-LM core_v0.16.1 (``../shared/consumers``): the emitted scripts' argv through ``parse_args``,
  ``validate_args`` and ``core_transformer_config_from_args`` (as tests/test_emit_consumers.py does for
  dense plans), then the MoE/MLA fields of Megatron's config against the plan, and the expert rank
  grid built with Megatron's own ``parallel_state.RankGenerator`` as ``initialize_model_parallel`` builds it.
* torchtitan 0.3.0: ``ConfigManager`` and ``ParallelDims`` on the emitted MoE launch.
* `plan3d check` reads the Megatron files back into the same plan and model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.check import check_file
from planner.emit import render_all
from planner.emit.megatron import moe_layer_freq, moe_layer_pattern_arg
from planner.io import write_all
from planner.memory import estimate_scenario_memory
from planner.presets import SpecError, load_hardware
from tests.test_emit_consumers import (  # noqa: F401  (megatron: the session fixture)
    ARCH,
    check_with_megatron,
    megatron,
    megatron_validate,
    scenario,
)

DSV3_STAGES = (3,) + (4,) * 14 + (2,)           # 61 layers on 16 stages, the ends one or two short
QWEN235_STAGES = (11,) + (12,) * 6 + (11,)      # 94 layers on 8 stages
TINY = dict(model="tiny-moe", gpus=8, global_batch=16, seq_len=1024)
MIXTRAL = dict(model="mixtral-8x7b", gpus=64, global_batch=128, seq_len=4096)
MOE_PLANS = {
    # tiny-moe: one dense layer then 3 MoE layers with a shared expert; EP folded into tp x dp
    "tiny-tp2-ep4-etp1": (TINY, dict(tp=2, pp=2, dp=2, ep=4, etp=1, sequence_parallel=True, zero_stage=1)),
    "tiny-tp1-ep8-zero0": (TINY, dict(tp=1, pp=1, dp=8, ep=8)),
    "mixtral-ep8-etp2-vpp2": (MIXTRAL, dict(tp=2, pp=4, dp=8, vpp=2, ep=8, etp=2, sequence_parallel=True,
                                            zero_stage=1, recompute="selective")),
    # DeepSeek-V3's published layout (arXiv:2412.19437 section 3.2.1): PP16 x EP64 x ZeRO-1 DP, no TP, 2,048 GPUs
    "deepseek-v3-pp16-ep64": (dict(model="deepseek-v3", gpus=2048, global_batch=4096, seq_len=4096),
                              dict(tp=1, pp=16, dp=128, ep=64, zero_stage=1, layers_per_stage=DSV3_STAGES)),
    # NVIDIA's H100 DeepSeek-V3 layout (Megatron-Bridge 25.09, 'Et|(tt|)*30mL'): uneven stages under
    # interleaving, so a --pipeline-model-parallel-layout, which must hold the MTP layer ('m')
    "deepseek-v3-tp2-pp8-vpp4-layout": (dict(model="deepseek-v3", gpus=512, global_batch=512, seq_len=4096),
                                        dict(tp=2, pp=8, dp=32, vpp=4, ep=64, etp=1, sequence_parallel=True,
                                             zero_stage=1, layers_per_stage=(7,) + (8,) * 6 + (6,))),
    "qwen3-235b-tp4-pp8-ep8-etp1": (dict(model="qwen3-235b-a22b", gpus=256, global_batch=512, seq_len=4096),
                                    dict(tp=4, pp=8, dp=8, ep=8, etp=1, sequence_parallel=True, zero_stage=1,
                                         layers_per_stage=QWEN235_STAGES)),
    # GLM-4.5 from its Hugging Face config: q/k/v bias, per-head Q/K norm, RoPE on half of each head, 3 dense layers,
    # an ungated shared expert and one MTP layer
    "glm-4.5-tp2-pp4-ep8": (dict(model=str(Path(__file__).parent / "data" / "hf" / "glm-4.5.json"), gpus=256,
                                 global_batch=512, seq_len=4096),
                            dict(tp=2, pp=4, dp=32, ep=8, etp=1, sequence_parallel=True, zero_stage=1)),
}


def _grouped_gemm_capability(monkeypatch, arch: int) -> None:
    """Stand-in for exactly one CUDA query: ``validate_args`` asks ``torch.cuda.get_device_capability()``
    when ``--moe-grouped-gemm`` is set ("Unsupported compute capability for GroupedGEMM kernels"); there is
    no GPU here, so answer the plan's GPU (H100: 9.0)."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (arch, 0))


def _args_file_argv(sc, tmp_path) -> list[str]:
    """torchrun's argv for the emitted argument file, passed on as docs/emit.md says ($(grep -v '^#' FILE))."""
    (path,) = [p for p in write_all(tmp_path / "args", render_all(sc, ["megatron"]))]
    words = " ".join(ln for ln in path.read_text().splitlines() if not ln.startswith("#")).split()
    nodes = sc.training.num_gpus // 8 if sc.training.num_gpus >= 8 else 1
    per_node = sc.training.num_gpus // nodes
    return ["--nnodes", str(nodes), "--nproc_per_node", str(per_node), "/opt/Megatron-LM/pretrain_gpt.py"] + words


def _expert_grid(arguments, p) -> tuple[int, list]:
    """(expert data-parallel size, pipeline groups equal?) as ``parallel_state.initialize_model_parallel``
    computes them, with Megatron's own RankGenerator and order ``tp-cp-ep-dp-pp``."""
    from megatron.core.parallel_state import RankGenerator

    world = p.world_size
    etp_ep_pp = p.expert_tp * p.ep * p.pp
    assert world % etp_ep_pp == 0, "initialize_model_parallel: world_size is not divisible by etp*ep*pp"
    edp = world // etp_ep_pp
    dense = RankGenerator(tp=p.tp, ep=1, dp=p.dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=p.expert_tp, ep=p.ep, dp=edp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    # initialize_model_parallel asserts the expert and dense pipeline groups are the same ranks
    assert dense.get_ranks("pp") == expert.get_ranks("pp")
    return edp, expert.get_ranks("ep")


@pytest.mark.parametrize("case", MOE_PLANS)
def test_megatron_accepts_emitted_moe_plans(megatron, monkeypatch, tmp_path, case):
    job, plan = MOE_PLANS[case]
    sc = scenario(**job, **plan)
    p, m = sc.resolved_plan(), sc.model
    arch = next(v for k, v in ARCH.items() if sc.hardware.name.startswith(k))
    _grouped_gemm_capability(monkeypatch, arch)
    check_with_megatron(megatron, monkeypatch, tmp_path, sc)  # the dense checks: degrees, batches, layers, ...
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1", arch)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == \
        (m.num_experts, m.top_k, m.moe_ffn_size)
    assert config.moe_shared_expert_intermediate_size == m.shared_expert_ffn_hidden_size
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(m.num_layers)] if isinstance(freq, int) else list(freq)
    assert pattern == [int(m.is_moe_layer(i)) for i in range(m.num_layers)]  # gpt_layer_specs.py's reading
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (p.ep, p.expert_tp)
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm
    assert config.moe_router_dtype == ("fp32" if m.router_dtype == "fp32" else None)
    assert config.moe_expert_capacity_factor == m.capacity_factor
    assert config.qk_layernorm == (m.qk_norm == "head" or m.is_mla)
    assert config.multi_latent_attention == m.is_mla
    assert (config.mtp_num_layers or 0) == m.mtp_num_layers  # DeepSeek-V3: its one MTP module
    # group-limited routing (DeepSeek-V3: 8 groups, 4 per token), as TransformerConfig validated it
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (m.router_num_groups, m.router_group_topk)
    if m.is_mla:
        assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
                config.v_head_dim) == (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                       m.v_head_dim)
    if p.ep > 1 and p.tp > 1:
        assert config.sequence_parallel  # MoELayer.forward refuses TP without SP in training
    edp, ep_groups = _expert_grid(megatron["arguments"], p)
    assert edp == p.expert_dp and len(ep_groups[0]) == p.ep


def test_megatron_accepts_the_allgather_dispatcher_without_grouped_gemm(megatron, monkeypatch, tmp_path):
    """A job with Megatron-Core's own defaults, the allgather dispatcher and SequentialMLP (moe_token_dispatcher
    allgather, moe_grouped_gemm False): written as --moe-token-dispatcher-type allgather and without
    --moe-grouped-gemm, and Megatron's validation builds exactly that config."""
    sc = scenario(**TINY, tp=2, pp=1, dp=4, ep=2, etp=2, sequence_parallel=True)
    sc = sc.model_copy(update={"training": sc.training.model_copy(
        update={"moe_token_dispatcher": "allgather", "moe_grouped_gemm": False})})
    argv = _args_file_argv(sc, tmp_path)
    assert "--moe-grouped-gemm" not in argv
    args, config, _ = megatron_validate(megatron, monkeypatch, argv, "1")
    assert config.moe_token_dispatcher_type == "allgather" and not config.moe_grouped_gemm


def test_megatron_moe_variants(megatron, monkeypatch, tmp_path):
    """A capacity factor (with padding to capacity), top-1 routing, a gated shared expert, a bf16 router."""
    sc = scenario(**TINY, tp=2, pp=1, dp=4, ep=2, etp=2, sequence_parallel=True)
    model = sc.model.model_copy(update={"capacity_factor": 1.25, "top_k": 1, "shared_expert_gate": True,
                                        "router_dtype": "bf16"})
    sc = sc.model_copy(update={"model": model})
    _grouped_gemm_capability(monkeypatch, 9)
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert config.moe_expert_capacity_factor == 1.25 and config.moe_pad_expert_input_to_capacity
    assert config.moe_router_topk == 1 and config.moe_router_pre_softmax
    assert config.moe_shared_expert_gate and config.moe_router_dtype is None
    assert config.expert_tensor_parallel_size == 2
    # GPT-OSS-shaped: biases on every linear layer and the router, attention sinks; expert TP 1 (Megatron's rule)
    oss = scenario(**TINY, tp=2, pp=1, dp=4, ep=2, etp=1, sequence_parallel=True)
    oss = oss.model_copy(update={"model": oss.model.model_copy(update={"linear_bias": True, "router_bias": True,
                                                                       "attention_sinks": True})})
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(oss, tmp_path / "oss"), "1")
    assert config.add_bias_linear and config.softmax_type == "learnable"
    assert config.expert_tensor_parallel_size == 1 and config.num_moe_experts == 8


def test_megatron_refuses_what_the_emitter_refuses(megatron, monkeypatch, tmp_path):
    """The refusals are Megatron's own: without the flag the emitter adds, Megatron fails the same way."""
    sc = scenario(**TINY, tp=2, pp=1, dp=4, ep=2, sequence_parallel=True)
    argv = _args_file_argv(sc, tmp_path)
    with pytest.raises(AssertionError, match="GroupedGEMM"):  # no stand-in: the CPU's answer refuses
        import torch

        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 0))
        megatron_validate(megatron, monkeypatch, argv, "1")
    _grouped_gemm_capability(monkeypatch, 9)
    i = argv.index("--moe-router-topk")
    with pytest.raises(ValueError, match="moe-router-pre-softmax"):  # top-1 softmax routing needs it
        megatron_validate(megatron, monkeypatch, argv[:i] + ["--moe-router-topk", "1"] + argv[i + 2:], "1")
    j = argv.index("--expert-model-parallel-size")
    with pytest.raises(AssertionError, match="multiple of expert model parallel"):
        megatron_validate(megatron, monkeypatch, argv[:j] + ["--expert-model-parallel-size", "3"] + argv[j + 2:], "1")


def test_megatron_refuses_moe_with_tp_and_no_sp_in_its_moe_layer(megatron, monkeypatch, tmp_path):
    """validate_args lets MoE with tp > 1 and no SP through (ModelParallelConfig only warns), but MoELayer.forward
    raises in training: the emitter's refusal rests on that code, asserted here at this version."""
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    source = inspect.getsource(MoELayer.forward)
    assert "self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel" in source
    assert "raise ValueError" in source
    _grouped_gemm_capability(monkeypatch, 9)
    argv = _args_file_argv(scenario(**TINY, tp=2, pp=1, dp=4, ep=2, sequence_parallel=True), tmp_path)
    argv.remove("--sequence-parallel")
    with pytest.warns(UserWarning, match="sequence parallelism must be used"):
        _, config, _ = megatron_validate(megatron, monkeypatch, argv, "1")
    assert not config.sequence_parallel and config.tensor_model_parallel_size == 2


def test_emit_refuses_moe_plans_megatron_cannot_run():
    with pytest.raises(ValueError, match="MoE layer trains with tp=2 only with sequence parallelism"):  # a plan rule
        render_all(scenario(**TINY, tp=2, pp=1, dp=4, ep=2), ["megatron"])
    biased = scenario(**TINY, tp=2, pp=1, dp=4, ep=2, sequence_parallel=True)
    biased = biased.model_copy(update={"model": biased.model.model_copy(update={"linear_bias": True,
                                                                                 "router_bias": True})})
    with pytest.raises(SpecError, match="etp 1"):
        render_all(biased, ["torchrun"])
    gapped = biased.model_copy(update={"model": biased.model.model_copy(update={"router_bias": False})})
    with pytest.raises(SpecError, match="router_bias"):
        render_all(gapped, ["slurm"])


def test_moe_layer_freq_is_megatrons_pattern(megatron):
    """The pattern string evaluates, with Megatron's own parser, to the dense-first list, and to any
    ``moe_layer_pattern`` (a short period, or its runs)."""
    arguments = megatron["arguments"]
    assert arguments.moe_freq_type(moe_layer_freq(61, 3)) == [0] * 3 + [1] * 58
    assert arguments.moe_freq_type(moe_layer_freq(4, 1)) == [0, 1, 1, 1]
    patterns = [(0, 1) * 24, (1, 0, 0, 0) * 12, (0, 0, 1) + (0, 1) * 30 + (1,), (1, 1, 0), (1,) * 10 + (0,) * 3]
    for pattern in patterns:
        text = moe_layer_pattern_arg(pattern)
        assert arguments.moe_freq_type(text) == list(pattern), text
    assert moe_layer_pattern_arg((0, 1) * 24) == "([0,1]*24)"


TINY_PATTERNS = [(1, 0, 1, 0), (0, 1, 1, 0)]


@pytest.mark.parametrize("pattern", TINY_PATTERNS)
def test_megatron_builds_a_moe_layer_pattern_as_emitted(megatron, monkeypatch, tmp_path, pattern):
    """A model with experts in some layers only (``moe_layer_pattern``): Megatron's own argument validation takes
    the emitted ``--moe-layer-freq``, its layer specs put experts where the pattern says, and check reads the
    launch back to the same model and memory."""
    sc = scenario(**TINY, tp=2, pp=2, dp=2, ep=2, etp=1, sequence_parallel=True, zero_stage=1)
    sc = sc.model_copy(update={"model": sc.model.model_copy(update={"first_k_dense": 0, "moe_layer_pattern": pattern})})
    _grouped_gemm_capability(monkeypatch, 9)
    _, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1", 9)
    freq = config.moe_layer_freq
    assert ([int(i % freq == 0) for i in range(4)] if isinstance(freq, int) else list(freq)) == list(pattern)
    (path,) = write_all(tmp_path / "emit", render_all(sc, ["megatron"]))
    result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
    assert not result.errors, result.errors
    assert _shape(result.scenario.model) == _shape(sc.model)
    assert estimate_scenario_memory(result.scenario).stages == estimate_scenario_memory(sc).stages


# --- plan3d check reads the MoE flags back ------------------------------------------------------------
def _shape(model) -> dict:
    """Every model field but the name; key/value heads as a count (None and a = 128 are one model) and the biases
    as resolved (None follows linear_bias: None and False are one model without them)."""
    biases = ("qkv_bias", "out_proj_bias", "mlp_bias")
    return model.model_dump(exclude={"name", "num_kv_heads", *biases}) | {"kv_heads": model.kv_heads} | \
        {b: getattr(model, f"has_{b}") for b in biases}


@pytest.mark.parametrize("case", MOE_PLANS)
def test_check_reads_moe_launch_files_back(tmp_path, case):
    job, plan = MOE_PLANS[case]
    sc = scenario(**job, **plan)
    files = write_all(tmp_path, render_all(sc, ["megatron", "torchrun", "slurm"]))
    expected = estimate_scenario_memory(sc)
    for path in files:
        if path.name.endswith(".plan.json"):
            continue
        result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
        assert not result.errors, result.errors
        assert result.scenario.resolved_plan() == sc.resolved_plan(), path.name
        assert _shape(result.scenario.model) == _shape(sc.model), path.name
        assert estimate_scenario_memory(result.scenario).stages == expected.stages, path.name


# --- torchtitan 0.3.0 -----------------------------------------------------------------------------------
TORCHTITAN_MOE_PLANS = {
    "qwen3-30b-tp2-ep8-etp1": (dict(model="qwen3-30b-a3b", gpus=16, global_batch=64, seq_len=4096),
                               dict(tp=2, pp=1, dp=8, ep=8, etp=1, sequence_parallel=True, zero_stage=1)),
    "qwen3-30b-tp2-ep1": (dict(model="qwen3-30b-a3b", gpus=16, global_batch=64, seq_len=4096),
                          dict(tp=2, pp=1, dp=8, sequence_parallel=True, zero_stage=3)),
    "qwen3-30b-zero0-ep-in-tp": (dict(model="qwen3-30b-a3b", gpus=16, global_batch=64, seq_len=4096),
                                 dict(tp=4, pp=1, dp=4, ep=4, etp=1, sequence_parallel=True)),
    "deepseek-v3-pp16-ep64": (dict(model="deepseek-v3", gpus=2048, global_batch=4096, seq_len=4096),
                              dict(tp=1, pp=16, dp=128, ep=64, zero_stage=1, layers_per_stage=DSV3_STAGES)),
    "deepseek-v3-pp8-tp2": (dict(model="deepseek-v3", gpus=512, global_batch=512, seq_len=4096),
                                dict(tp=2, pp=8, dp=32, ep=32, etp=1, zero_stage=1, sequence_parallel=True,
                                     layers_per_stage=(7,) + (8,) * 6 + (6,))),
}


@pytest.fixture(scope="module")
def titan():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import pipeline_parallel as pipe

    return ConfigManager, ParallelDims, pipe


@pytest.mark.parametrize("case", TORCHTITAN_MOE_PLANS)
def test_torchtitan_accepts_emitted_moe_plans(titan, tmp_path, case):
    from tests.test_emit_consumers import _torchtitan_argv

    ConfigManager, ParallelDims, pipe = titan
    job, plan = TORCHTITAN_MOE_PLANS[case]
    sc = scenario(**job, **plan)
    # torchtitan's 671B flavour builds no MTP layer; plan3d refuses to emit one (test_torchtitan_refuses_mtp)
    sc = sc.model_copy(update={"model": sc.model.model_copy(update={"mtp_num_layers": 0})})
    p = sc.resolved_plan()
    (script,) = write_all(tmp_path / "o", render_all(sc, ["torchtitan"]))
    world, argv = _torchtitan_argv(script, tmp_path / "run")
    assert world == sc.training.num_gpus
    cfg = ConfigManager().parse_args(argv)  # tyro parse + Trainer.Config.__post_init__
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world)  # the degrees multiply to WORLD_SIZE
    assert (dims.tp, dims.pp, dims.cp, dims.ep, dims.dp_replicate * dims.dp_shard) == (p.tp, p.pp, p.cp, p.ep, p.dp)
    if dims.ep > 1:
        # ParallelismConfig.expert_parallel_degree: "dp_shard * cp * tp == efsdp * ep" (build_mesh's efsdp);
        # an expert shard's replicas, efsdp x dp_replicate, are plan3d's expert data-parallel degree
        efsdp, rest = divmod(dims.dp_shard * dims.cp * dims.tp, dims.ep)
        assert rest == 0 and efsdp >= 1 and efsdp * dims.dp_replicate == p.expert_dp and p.expert_tp == 1
    else:  # experts on the dense mesh, split over tp, replicated over dp x cp
        assert p.expert_tp == dims.tp and dims.dp_replicate * dims.dp_shard * dims.cp == p.expert_dp
    read = check_file(script, load_hardware("h100-sxm-80gb"), None, None)  # plan3d check reads it back
    assert not read.errors, read.errors
    rp = read.scenario.resolved_plan()
    assert (rp.tp, rp.pp, rp.dp, rp.cp, rp.ep, rp.expert_tp, rp.layers_per_stage) == \
        (p.tp, p.pp, p.dp, p.cp, p.ep, p.expert_tp, p.layers_per_stage)
    assert _shape(read.scenario.model) == _shape(sc.model)
    model = cfg.model_spec.model
    assert cfg.model_spec.name == {"deepseek-v3": "deepseek_v3", "qwen3-30b-a3b": "qwen3"}[sc.model.name]
    moe = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    assert len(moe) == sc.model.num_moe_layers and len(model.layers) == sc.model.num_layers
    # what Trainer.__init__ calls next: the model's sharding for these degrees (enable_ep = ep > 1)
    model.update_from_config(config=cfg)
    if dims.pp > 1:  # pipeline_llm's own split puts the plan's layers on every virtual stage
        num_stages, num_layers, first_less, last_less = pipe._get_pipeline_metadata(dims, par, model)
        parts = pipe._generate_llm_fqn_per_model_part(num_stages, num_layers, first_less, last_less)
        per_stage = [sum(name.startswith("layers.") for name in part) for part in parts]
        per_rank = [sum(per_stage[s] for s in range(r, num_stages, p.pp)) for r in range(p.pp)]
        assert per_rank == list(p.layers_per_stage), per_stage


def test_torchtitan_refusal_of_gpt_oss_names_the_config_torchtitan_has(titan):
    """torchtitan 0.3.0 ships GPT-OSS (its own config functions, read here from the installed library); plan3d does not
    write that launch (planner.emit.torchtitan.NOT_WRITTEN) and must not say torchtitan has no such model."""
    from torchtitan.models.gpt_oss import config_registry

    from planner.emit.torchtitan import NOT_WRITTEN

    for preset, config in NOT_WRITTEN.items():
        assert callable(getattr(config_registry, config))
        sc = scenario(model=preset, gpus=64, global_batch=64, seq_len=4096, tp=1, pp=1, dp=64, ep=8, zero_stage=1)
        with pytest.raises(SpecError, match=f"torchtitan 0.3.0 has {config}, but plan3d writes no torchtitan launch"):
            render_all(sc, ["torchtitan"])


def test_torchtitan_refuses_moe_it_cannot_run():
    with pytest.raises(SpecError, match="ships no model for qwen3-235b-a22b"):  # a flavour, no config function
        render_all(scenario(**MOE_PLANS["qwen3-235b-tp4-pp8-ep8-etp1"][0], **MOE_PLANS["qwen3-235b-tp4-pp8-ep8-etp1"][1]),
                   ["torchtitan"])
    with pytest.raises(SpecError, match="ships no model for mixtral-8x7b"):
        render_all(scenario(**MIXTRAL, tp=2, pp=4, dp=8, ep=8, sequence_parallel=True), ["torchtitan"])
    q30 = dict(model="qwen3-30b-a3b", gpus=16, global_batch=64, seq_len=4096)
    with pytest.raises(SpecError, match="set etp 1"):
        render_all(scenario(**q30, tp=2, pp=1, dp=8, ep=4, sequence_parallel=True, zero_stage=1), ["torchtitan"])
    with pytest.raises(SpecError, match="etp = tp"):
        render_all(scenario(**q30, tp=2, pp=1, dp=8, etp=1, sequence_parallel=True, zero_stage=1), ["torchtitan"])
    with pytest.raises(SpecError, match="ZeRO 0 keeps dp as replicas"):  # ep 8 folds into dp, which is dp_replicate
        render_all(scenario(**q30, tp=2, pp=1, dp=8, ep=8, etp=1, sequence_parallel=True), ["torchtitan"])
    with pytest.raises(SpecError, match="trains in bf16"):
        render_all(scenario(**q30, precision="fp8", tp=2, pp=1, dp=8, sequence_parallel=True), ["torchtitan"])


def test_torchtitan_fp8_deepseek_names_torchtitans_float8_config(titan):
    """The fp8 config needs torchao to build (not installed here), so its name and its float8 converters are
    checked in torchtitan's own registry instead of being parsed."""
    import inspect

    from planner.emit.torchtitan import args
    from torchtitan.models.deepseek_v3 import config_registry

    job = dict(model="deepseek-v3", gpus=512, global_batch=512, seq_len=4096)
    plan = dict(tp=1, pp=8, dp=64, ep=64, zero_stage=1, layers_per_stage=(7,) + (8,) * 6 + (6,))
    for precision, float8 in (("fp8", True), ("bf16", False)):
        words = args(scenario(**job, precision=precision, **plan))
        source = inspect.getsource(getattr(config_registry, words[words.index("--config") + 1]))
        assert ("Float8LinearConverter" in source and "Float8GroupedExpertsConverter" in source) == float8


def test_check_reads_moe_variants_back(tmp_path):
    """Capacity factor, top-1, gated shared expert, bf16 router, attention sinks; MLA without a q rank."""
    sc = scenario(**TINY, tp=2, pp=2, dp=2, ep=2, sequence_parallel=True)
    variants = [sc.model.model_copy(update={"capacity_factor": 1.25, "top_k": 1, "shared_expert_gate": True,
                                            "router_dtype": "bf16", "attention_sinks": True, "first_k_dense": 0}),
                sc.model.model_copy(update={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                            "v_head_dim": 16, "num_kv_heads": None, "first_k_dense": 2})]
    for i, model in enumerate(variants):
        v = sc.model_copy(update={"model": model})
        (path,) = write_all(tmp_path / str(i), render_all(v, ["megatron"]))
        result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
        assert not result.errors, result.errors
        assert _shape(result.scenario.model) == _shape(model)
        assert result.scenario.resolved_plan() == v.resolved_plan()


ARGS_BASE = """# plan3d: num_gpus=8
--num-layers 4 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 --seq-length 1024
--max-position-embeddings 1024 --micro-batch-size 1 --bf16 --tokenizer-type NullTokenizer --vocab-size 511
--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear
--num-experts 8 --expert-model-parallel-size 8
"""


@pytest.mark.parametrize("extra,wanted", [
    ("", {"first_k_dense": 0, "top_k": 2, "moe_ffn_hidden_size": None, "router_dtype": "bf16",
          "capacity_factor": None}),  # Megatron's defaults (TransformerConfig, validate_args)
    ("--moe-layer-freq 1 --moe-expert-capacity-factor -1", {"first_k_dense": 0, "capacity_factor": None}),
    ("--moe-layer-freq ([0]+[1]*3)", {"first_k_dense": 1}),
    ("--moe-layer-freq [0,0,1,1]", {"first_k_dense": 2}),
    ("--moe-layer-freq 2*[0]+[1]+[1]", {"first_k_dense": 2}),
    # any other pattern (read as dense-first only before 2026-12-07): Megatron's integer N is i % N == 0
    ("--moe-layer-freq 2", {"first_k_dense": 0, "moe_layer_pattern": (1, 0, 1, 0)}),
    ("--moe-layer-freq ([0,1]*2)", {"first_k_dense": 0, "moe_layer_pattern": (0, 1, 0, 1)}),
    ("--moe-layer-freq [1,1,0,1]", {"first_k_dense": 0, "moe_layer_pattern": (1, 1, 0, 1)}),
    ("--moe-layer-freq [1,1,1,1]", {"first_k_dense": 0, "moe_layer_pattern": None}),
    ("--moe-router-num-groups 4 --moe-router-group-topk 2", {"router_num_groups": 4, "router_group_topk": 2}),
    ("--moe-router-num-groups 4", {"router_num_groups": None, "router_group_topk": None}),  # no group top-k: no limit
    ("--moe-router-num-groups 1 --moe-router-group-topk 1", {"router_num_groups": None}),  # one group: no limit
    ("--moe-router-dtype fp64 --moe-ffn-hidden-size 128", {"router_dtype": "fp32", "moe_ffn_hidden_size": 128}),
    ("--multi-latent-attention --qk-layernorm", {"kv_lora_rank": 32, "qk_nope_head_dim": 128,
                                                 "qk_rope_head_dim": 64, "v_head_dim": 128, "q_lora_rank": None,
                                                 "qk_norm": "none"}),  # MLA's argparse defaults
])
def test_check_reads_megatron_moe_defaults(tmp_path, extra, wanted):
    path = tmp_path / "moe.megatron.args"
    path.write_text(ARGS_BASE + extra + "\n")
    result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
    assert not result.errors, result.errors
    got = result.scenario.model.model_dump()
    assert {k: got[k] for k in wanted} == wanted
    assert result.scenario.plan.ep == 8 and result.scenario.plan.etp is None


@pytest.mark.parametrize("extra,error", [
    ("--moe-layer-freq ([0]+[1]*5)", "lists 6 layers"),
    ("--moe-layer-freq [0]*4", "experts on no layer"),                # no MoE layer at all
    ("--moe-layer-freq [0,2,1,1]", "marks each layer 0 (dense) or 1 (MoE)"),
    ("--moe-layer-freq [1]*99999999999", "longer than"),              # bounded, never built
    ("--moe-layer-freq [__import__('os')]", "allows only digits"),    # never evaluated
    ("--moe-layer-freq every", "neither an integer nor a list"),
    ("--moe-layer-freq [[1]]*4", "not a list expression"),
    ("--moe-latent-size 64", "latent projections"),
    ("--moe-router-group-topk 2", "moe_router_num_groups must be specified"),
    ("--moe-router-num-groups 3 --moe-router-group-topk 2", "router_num_groups: 3 does not divide num_experts(8)"),
    ("--multi-latent-attention --group-query-attention", "refuses the pair"),
    ("--expert-model-parallel-size 3", "not divisible by ep(3)"),     # plan3d's rule, as Megatron's assert
])
def test_check_refuses_moe_it_does_not_model(tmp_path, extra, error):
    path = tmp_path / "moe.megatron.args"
    path.write_text(ARGS_BASE + extra + "\n")
    result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
    assert result.errors and error in result.errors[0], result.errors
    assert "\n" not in result.errors[0]


def test_check_refuses_deepspeed_moe(tmp_path):
    path = tmp_path / "ds.sh"
    path.write_text("deepspeed --num_gpus 8 pretrain_gpt.py --deepspeed --deepspeed_config ds.json "
                    "--num-experts 8 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 1024 "
                    "--max-position-embeddings 1024 --micro-batch-size 1 --vocab-size 512\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
    assert result.errors and "DeepSpeed-MoE" in result.errors[0], result.errors


def test_deepspeed_refuses_expert_parallelism():
    """DeepSpeed-MoE's expert parallelism lives in model code (deepspeed.moe.layer.MoE ep_size), not the config."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (the Makefile installs it)")
    import inspect

    from deepspeed.moe.layer import MoE

    assert "ep_size" in inspect.signature(MoE.__init__).parameters
    with pytest.raises(SpecError, match="DeepSpeed-MoE") as err:
        render_all(scenario(**TINY, tp=1, pp=1, dp=8, ep=8), ["deepspeed"])
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="etp=1"):
        render_all(scenario(**TINY, tp=2, pp=1, dp=4, etp=1, sequence_parallel=True), ["deepspeed"])
    assert render_all(scenario(**TINY, tp=1, pp=1, dp=8), ["deepspeed"])  # ep 1: batches and ZeRO only


def test_megatron_accepts_an_fp8_moe_plan(megatron, monkeypatch, tmp_path):
    """fp8 MoE: TransformerConfig asks Transformer Engine's version (>= 1.7 for MoE fp8, >= 1.11 for fp8
    grouped GEMM); TE needs CUDA and is absent here, so answer as an image with a recent TE would, for this
    plan only. Everything else is Megatron's own check."""
    import megatron.core.transformer.transformer_config as tc

    asked = []
    monkeypatch.setattr(tc, "is_te_min_version", lambda version, *a, **k: asked.append(version) or True)
    _grouped_gemm_capability(monkeypatch, 9)
    sc = scenario(**MIXTRAL, precision="fp8", tp=2, pp=4, dp=8, ep=8, etp=2, sequence_parallel=True, zero_stage=1)
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert config.fp8 == "hybrid" and config.num_moe_experts == 8 and config.moe_grouped_gemm
    assert {"1.7.0.dev0", "1.11.0"} <= set(asked)  # the MoE fp8 checks ran


def test_megatron_runs_the_jobs_dispatcher_and_a2a_overlap(megatron, monkeypatch, tmp_path):
    """The job's MoE switches reach Megatron's config: deepep is the flex dispatcher with the DeepEP backend,
    moe_a2a_overlap is --overlap-moe-expert-parallel-comm (interleaved, as Megatron requires with pp > 1)."""
    sc = scenario(**TINY, tp=1, pp=2, dp=4, vpp=2, ep=4, etp=1)
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"moe_token_dispatcher": "deepep",
                                                                          "moe_a2a_overlap": True})})
    _grouped_gemm_capability(monkeypatch, 9)
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "deepep"
    assert config.overlap_moe_expert_parallel_comm


@pytest.mark.parametrize("plan,says", [
    (dict(tp=1, pp=1, dp=8, ep=1), "needs expert parallelism"),
    (dict(tp=1, pp=2, dp=4, ep=4), "needs virtual pipeline stages"),
    (dict(tp=1, pp=1, dp=8, ep=8, recompute="full"), "refuses full recomputation"),
])
def test_emit_refuses_a2a_overlap_megatron_cannot_run(plan, says):
    from planner.emit import megatron as emit_megatron

    sc = scenario(**TINY, **plan)
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"moe_a2a_overlap": True})})
    assert any(says in e for e in emit_megatron.moe_plan_refusals(sc))


def test_megatron_captures_the_jobs_cuda_graph_modules(megatron, monkeypatch, tmp_path):
    """cuda_graph_modules reach Megatron's own parser and config as --cuda-graph-impl transformer_engine
    --cuda-graph-scope attn moe_router moe_preprocess (several values, one flag)."""
    sc = scenario(**TINY, tp=1, pp=1, dp=8, ep=8)
    graphs = ("attn", "moe_router", "moe_preprocess")
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"cuda_graph_modules": graphs})})
    _grouped_gemm_capability(monkeypatch, 9)
    args, config, _ = megatron_validate(megatron, monkeypatch, _args_file_argv(sc, tmp_path), "1")
    assert config.cuda_graph_impl == "transformer_engine"
    assert [s.name for s in config.cuda_graph_scope] == list(graphs)


def test_emit_refuses_moe_graph_scopes_on_a_dense_model():
    from planner.emit import megatron as emit_megatron

    sc = scenario(model="tiny-gpt", gpus=8, global_batch=16, seq_len=512, tp=1, pp=1, dp=8)
    sc = sc.model_copy(update={"training": sc.training.model_copy(update={"cuda_graph_modules": ("moe_router",)})})
    with pytest.raises(SpecError, match="moe_\\* scopes need a MoE model"):
        emit_megatron.megatron_flags(sc)


def test_torchtitan_refuses_mtp():
    """DeepSeek-V3's preset trains one MTP module (as Megatron-Bridge's recipes do); the torchtitan flavour plan3d
    writes (deepseek_v3_671b) builds none, so the job is refused in one line naming the field."""
    from planner.specs import job_problems

    sc = scenario(**TORCHTITAN_MOE_PLANS["deepseek-v3-pp16-ep64"][0], **TORCHTITAN_MOE_PLANS["deepseek-v3-pp16-ep64"][1])
    assert sc.model.mtp_num_layers == 1
    titan = sc.training.model_copy(update={"framework": "torchtitan"})
    problems = job_problems(sc.model, sc.hardware, titan)
    assert any(p.startswith("mtp_num_layers: torchtitan") for p in problems), problems
    assert not [p for p in job_problems(sc.model, sc.hardware, sc.training) if p.startswith("mtp_num_layers")]


def test_check_reads_the_all_to_all_overlap(tmp_path):
    """--overlap-moe-expert-parallel-comm holds one more layer's activations on a pp 1 rank (the merged step,
    memory.a2a_overlap_extra_layers): check reads the flag, or it would judge such a launch lighter than it runs."""
    peaks = []
    for extra in ("", "--overlap-moe-expert-parallel-comm"):
        path = tmp_path / f"moe{len(peaks)}.megatron.args"
        path.write_text(ARGS_BASE + "--moe-token-dispatcher-type alltoall " + extra + "\n")
        result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
        assert not result.errors, result.errors
        assert result.scenario.training.moe_a2a_overlap is bool(extra)
        peaks.append(estimate_scenario_memory(result.scenario).peak.total_bytes)
    assert peaks[1] > peaks[0]


def test_check_refuses_the_all_to_all_overlap_under_megatrons_default_dispatcher(tmp_path):
    """Without --moe-token-dispatcher-type Megatron dispatches with allgather, and TransformerConfig asserts
    'overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher' (core_v0.16.1): so does
    check."""
    path = tmp_path / "moe.megatron.args"
    path.write_text(ARGS_BASE + "--overlap-moe-expert-parallel-comm\n")
    result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
    assert any("alltoall or flex dispatcher" in e for e in result.errors), result.errors
