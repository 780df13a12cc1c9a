"""The parameters one GPU of each pipeline stage holds, as plan3d counts them (planner.memory ``stage_param_split``:
dense and routed-expert parts), against what Megatron-Core core_v0.16.1 itself builds on that pipeline rank from the
arguments ``plan3d emit megatron`` writes for the plan (tests/megatron_params_probe.py: Megatron's parse_args,
validate_args, config build, parallel_state and GPTModel with its local layer specs on the meta device, under a fake
process group; its stand-ins are named there). Every count that feeds the states, the ZeRO shards and the DP
traffic comes from these two functions, so they must be Megatron's to the parameter. Covers tensor, pipeline
(uneven, interleaved), expert (with expert TP) parallelism, GQA, learned positions with tied embeddings and biases,
QK norms, shared experts, dense-first layers, multi-latent attention and the MTP module, on presets and on published
Hugging Face configs read by planner.hf; and the scenarios `plan3d check` reads from Megatron-LM launch files against
Megatron's build from each file's own arguments. It found that a config with no ``max_position_embeddings`` was emitted
without ``--max-position-embeddings``, which Megatron's validate_args refuses. Skips, with the reason, where
../shared is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.emit import render_all
from planner.estimate import estimate
from planner.memory import stage_param_split
from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec

pytest.importorskip("torch", reason="Megatron-Core runs on torch")

HF = Path(__file__).resolve().parent / "data" / "hf"  # published Hugging Face configs (tests/data/README.md)
#: compute capability major per profile (tests/test_emit_consumers.py ARCH)
ARCH = {"h100-sxm-80gb": 9, "gb200-nvl72": 10}


def _scenario(model: str, gpus: int, layers: int | None = None, hardware: str = "h100-sxm-80gb",
              model_update: dict | None = None, **plan) -> Scenario:
    """``model`` (with ``model_update``) with ``layers`` layers (fewer than the preset's keeps the build quick on 2
    cores; the widths are the preset's), on ``gpus`` GPUs, with ``plan``."""
    m = load_model(str(HF / model) if model.endswith(".json") else model).model_copy(update=model_update or {})
    if layers is not None:
        m = m.model_copy(update={"num_layers": layers})
    p = Plan(**({"micro_batch_size": 1} | plan))
    return Scenario(model=m, hardware=load_hardware(hardware),
                    training=TrainingSpec(num_gpus=gpus, global_batch_size=16 * p.dp, seq_len=1024),
                    plan=p)


CASES = {
    "llama3-8b tp2 pp2 vpp2": _scenario("llama3-8b", 8, 8, tp=2, pp=2, dp=2, vpp=2, sequence_parallel=True),
    "llama3-70b tp8 pp4 uneven": _scenario("llama3-70b", 32, 10, tp=8, pp=4, dp=1, sequence_parallel=True,
                                           layers_per_stage=(2, 3, 3, 2)),
    # Meta's Llama 3 405B layout (benchmarks/data/llama3_405b_meta.json): interleaved, the first and last stage a layer
    # short, so their first / last chunk holds only the embedding / the output layer (Megatron's pipeline layout)
    "llama3-405b tp8 pp16 vpp8 (Meta's layout)": _scenario("llama3-405b", 128, None, tp=8, pp=16, dp=1, vpp=8,
                                                           sequence_parallel=True,
                                                           layers_per_stage=(7,) + (8,) * 14 + (7,)),
    "gpt3-175b tp4 pp2 (tied, learned positions, biases)": _scenario("gpt3-175b", 8, 4, tp=4, pp=2, dp=1,
                                                                     sequence_parallel=True),
    "mixtral-8x7b tp2 pp2 ep4": _scenario("mixtral-8x7b", 16, 4, tp=2, pp=2, dp=4, ep=4, etp=1,
                                          sequence_parallel=True),
    "mixtral-8x7b tp2 ep2 etp2": _scenario("mixtral-8x7b", 8, 2, tp=2, pp=1, dp=4, ep=2, etp=2,
                                           sequence_parallel=True),
    "qwen3-30b-a3b pp2 ep8 (QK norm)": _scenario("qwen3-30b-a3b", 16, 4, tp=1, pp=2, dp=8, ep=8),
    # read from published Hugging Face configs (planner.hf): biases on q/k/v, tied embeddings, a gated shared
    # expert, MLA without a q down-projection
    "HF qwen2.5-7b tp2 pp2 (qkv bias)": _scenario("qwen2.5-7b.json", 8, 4, tp=2, pp=2, dp=2, sequence_parallel=True),
    "HF qwen2.5-0.5b tp2 pp2 (tied)": _scenario("qwen2.5-0.5b.json", 8, 4, tp=2, pp=2, dp=2, sequence_parallel=True),
    "HF phi-3-mini tp2 pp2": _scenario("phi-3-mini-4k-instruct.json", 8, 4, tp=2, pp=2, dp=2, sequence_parallel=True),
    "HF gpt2 tp2 pp2 (learned positions, biases, tied)": _scenario("gpt2.json", 8, 4, tp=2, pp=2, dp=2,
                                                                   sequence_parallel=True),
    "HF qwen3-8b tp2 (QK norm)": _scenario("qwen3-8b.json", 8, 2, tp=2, pp=1, dp=4, sequence_parallel=True),
    "HF qwen1.5-moe-a2.7b pp2 ep4 (gated shared expert)": _scenario("qwen1.5-moe-a2.7b.json", 8, 4, tp=1, pp=2, dp=4,
                                                                   ep=4),
    "HF deepseek-v2-lite pp2 ep8 (MLA without q LoRA)": _scenario("deepseek-v2-lite.json", 16, 4, tp=1, pp=2, dp=8,
                                                                  ep=8),
    # GPT-OSS's parameters (attention sinks, biases on every linear layer, router and experts) without what the
    # Megatron formats refuse of it (YaRN, sliding windows, the clamped activation: ModelSpec.megatron_gaps)
    "gpt-oss-20b shape tp2 pp2 ep4 (sinks, all biases)": _scenario(
        "gpt-oss-20b", 16, 4, tp=2, pp=2, dp=4, ep=4, etp=1, sequence_parallel=True,
        model_update={"rope_scaling": None, "sliding_window": None, "sliding_window_layers": None,
                      "swiglu_limit": None}),
    "deepseek-v3 pp2 ep8 (MLA, shared experts, dense first, MTP)": _scenario(
        "deepseek-v3", 16, 5, tp=1, pp=2, dp=8, ep=8, layers_per_stage=(3, 2)),
}


#: Megatron-LM launch files `plan3d check` reads (tests/test_check_megatron.py: its reader against Megatron's
#: validate_args), here built by Megatron on every pipeline rank from the arguments `check` found
LAUNCH = Path(__file__).resolve().parent / "data" / "launch"
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-size", "--vocab-file", "--merge-file")


def _launch_cases() -> dict:
    """{name: (the scenario `check` reads, the launch's own arguments)} for every launch file and branch of
    tests/test_check_megatron.py. Megatron cannot build the files' tokenizers here (their files are not read), so the
    tokenizer flags are replaced by the NullTokenizer of the vocabulary `check` found; tests/test_check_megatron.py
    checks that vocabulary against Megatron's own padding."""
    from planner.check import check_file_branches, read_flags
    from tests.test_check_megatron import DROPPED, MEGATRON_LM_FILES, _branch_args

    out = {}
    for name in MEGATRON_LM_FILES:
        path = LAUNCH / name
        for r in check_file_branches(path, load_hardware("h200-141gb"), None, None):
            args = read_flags(path) if r.branch is None else _branch_args(path, r.branch)
            words = []
            for flag, value in args.values.items():
                if flag in DROPPED or flag in TOKENIZER_FLAGS:
                    continue
                words += [flag] + (value if isinstance(value, list) else [] if value is None else [value])
            words += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(r.scenario.model.vocab_size - 1)]
            out[f"check {name}" + (f" [{r.branch}]" if r.branch else "")] = (r.scenario, words)
    return out


@pytest.fixture(scope="module")
def launches(megatron_lm_root):
    return _launch_cases()


@pytest.fixture(scope="module")
def megatron_core(megatron_lm_root, launches, tmp_path_factory):
    from tests.subprocess_probe import REPO, run_json_probe

    cases = []
    for name, sc in CASES.items():
        (args_text,) = [t for f, t in render_all(sc, ["megatron"]).items() if f.endswith(".megatron.args")]
        words = " ".join(ln for ln in args_text.splitlines() if not ln.startswith("#")).split()
        cases.append({"name": name, "words": words, "world": sc.training.num_gpus, "arch": ARCH[sc.hardware.name],
                      "fsdp": sc.plan.zero_stage >= 2})
    for name, (sc, words) in launches.items():
        cases.append({"name": name, "words": words, "world": sc.training.num_gpus, "arch": 9,  # H200
                      "fsdp": sc.plan.zero_stage >= 2})
    path = tmp_path_factory.mktemp("megatron-params") / "cases.json"
    path.write_text(json.dumps(cases))
    out = run_json_probe(REPO / "tests/megatron_params_probe.py", timeout_s=900,
                         extra_args=[str(megatron_lm_root), str(path)])
    return {c["name"]: c for c in out["cases"]}


@pytest.mark.parametrize("name", CASES)
def test_stage_parameters_are_the_ones_megatron_builds(megatron_core, name):
    sc = CASES[name]
    plan = sc.resolved_plan()
    got = megatron_core[name]
    layers = plan.stage_layers(sc.model.num_layers)
    want = [stage_param_split(sc.model, plan, s, n) for s, n in enumerate(layers)]
    local = local_spec_mla_split(sc.model, plan.tp)  # 0 here: the MLA cases run at TP 1
    assert [tuple(r) for r in got["ranks"]] == [(dense + expert - n * local, expert)
                                                for (dense, expert), n in zip(want, layers)], name


@pytest.mark.parametrize("name", CASES)
def test_model_flops_are_the_ones_megatron_logs(megatron_core, name):
    """plan3d's model FLOPs (MFU, TFLOP/s per GPU) are Megatron-LM's own ``num_floating_point_operations`` on the
    emitted arguments, so a prediction and Megatron's logged throughput count the same work."""
    sc = CASES[name]
    est = estimate(sc)
    want = megatron_core[name]["flops_per_step"]
    assert est.model_flops_per_step == pytest.approx(want, rel=1e-12), name
    assert est.time.tflops_per_gpu * est.time.step_time_s * sc.training.num_gpus * 1e12 == pytest.approx(want)


def local_spec_mla_split(model, tp: int) -> float:
    """Parameters per layer and TP rank that the probe's local layer spec splits over TP and the Transformer Engine
    spec (what runs on GPUs, and what plan3d counts) replicates: MLA's ``h x r_q`` and ``h x (r_kv + rope)``
    down-projections (tests/megatron_params_probe.py)."""
    if not model.is_mla:
        return 0.0
    h = model.hidden_size
    return (h * (model.q_lora_rank or 0) + h * (model.kv_lora_rank + model.qk_rope_head_dim)) * (1 - 1 / tp)


def test_check_counts_the_parameters_megatron_builds_from_real_launches(megatron_core, launches):
    """`plan3d check`'s CI gate on real Megatron-LM launch files: the parameters of every pipeline rank of the
    scenario it reads are the ones Megatron builds from that launch's own arguments. One known difference, stated
    exactly: with fewer KV groups than TP ranks (megatron_gqa_default.sh: one group, TP 4) Megatron splits the fused
    QKV weight evenly and all-gathers its output in every layer (core_v0.16.1 ``attention.py``,
    ``get_query_key_value_tensors``: "When tp_size > num_kv_heads, we split 'q1 q2 k1 v1' over multiple ranks"),
    where plan3d counts a whole KV head on every rank (``memory.kv_heads_per_rank``): ``h x 2 d (1 - g / t)`` more
    per layer (docs/memory.md, Known limits). And the probe's local spec splits MLA's down-projections, which the
    TE spec replicates (:func:`local_spec_mla_split`)."""
    from tests.test_check_megatron import MEGATRON_LM_FILES

    assert len(launches) >= len(MEGATRON_LM_FILES)
    replicated = 0
    for name, (sc, _) in launches.items():
        plan, m = sc.resolved_plan(), sc.model
        layers = plan.stage_layers(m.num_layers)
        want = [stage_param_split(m, plan, s, n) for s, n in enumerate(layers)]
        extra = 0.0
        if m.kv_heads < plan.tp and not m.is_mla:
            extra = m.hidden_size * 2 * m.kv_channels * (1 - m.kv_heads / plan.tp)
            replicated += 1
        extra += local_spec_mla_split(m, plan.tp)
        # without expert parallelism Megatron keeps the experts' allreduce attribute True (tensor_parallel/layers.py:
        # ``not (is_expert and expert_parallel)``), so its DDP holds them with the dense parameters: shard groups of the
        # same size when etp = tp (Plan.expert_dp = dp x cp), so only their sum is compared
        assert [tuple(r) for r in megatron_core[name]["ranks"]] == [(d + e - n * extra, e if plan.ep > 1 else 0)
                                                                    for (d, e), n in zip(want, layers)], name
    assert replicated == 1  # megatron_gqa_default.sh


@pytest.mark.parametrize("name", CASES)
def test_dist_muon_deals_as_megatron_does(megatron_core, name):
    """dist_muon's optimizer bytes on the fullest GPU of each stage (planner.muon: fp32 master + momentum on the Muon
    weights, Adam's 12 B on the rest, whole parameters dealt by size over dp x cp and the expert-data-parallel ranks)
    against Megatron's own ``LayerWiseDistributedOptimizer.shard_params`` dealing the parameters Megatron builds on
    that pipeline rank (tests/megatron_params_probe.py ``_muon_dealt``): the fullest dense rank plus the fullest expert
    rank. Equal to the byte (before 2026-12-07 it found three differences: a learned position table and the MTP
    modules' word embedding are Muon's, not Adam's, and Muon's groups come before Adam's among equal sizes)."""
    from planner.muon import optimizer_bytes

    sc = CASES[name]
    plan = sc.resolved_plan()
    got = megatron_core[name]["muon"]
    for stage, layers in enumerate(plan.stage_layers(sc.model.num_layers)):
        mine = optimizer_bytes(sc.model, plan, stage, layers, "dist_muon", 12, 4, plan.dp * plan.cp, plan.expert_dp)
        assert mine == sum(got[stage]), (name, stage, mine, got[stage])
