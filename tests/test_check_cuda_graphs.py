"""`plan3d check` on Megatron launches with CUDA graphs or a non-default context-parallel communication: read as
Megatron-LM core_v0.16.1 reads the flags (``arguments.py`` ``validate_args``, ``TransformerConfig.cuda_graph_impl``
and ``cp_comm_type``), with the parts plan3d does not count named in notes, and the scopes `plan3d emit megatron`
writes read back."""

from pathlib import Path

import pytest

from planner.check import check_file_branches
from planner.emit import render_all
from planner.io import write_all
from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec

LAUNCH = Path(__file__).parent / "data" / "launch"
H100 = load_hardware("h100-sxm-80gb")


def _check(tmp_path, base: str, flags: str):
    script = tmp_path / "train.sh"
    script.write_text((LAUNCH / base).read_text().replace("--bf16", "--bf16 " + flags, 1))
    (r,) = check_file_branches(script, H100, None, None)
    return r


@pytest.mark.parametrize("flags, modules, eager", [
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router moe_preprocess",
     ("attn", "moe_router", "moe_preprocess"), None),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn", ("attn",), None),
    ("--external-cuda-graph --cuda-graph-scope moe_router", ("moe_router",), None),  # deprecated: transformer_engine
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn mlp", ("attn",), "mlp"),  # mlp: not modelled
    # the whole MoE layer, with the drop-and-pad routing Megatron requires for it
    ("--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine "
     "--cuda-graph-scope attn moe", ("attn", "moe"), None),
    ("--cuda-graph-impl transformer_engine", (), "the whole layer"),  # no scope: the whole layer
    ("--cuda-graph-impl local", (), "the whole layer"),  # MCore's CudaGraphManager
    ("--enable-cuda-graph", (), "the whole layer"),  # deprecated: local
])
def test_cuda_graph_scopes_are_read_and_their_memory_noted(tmp_path, flags, modules, eager):
    """The scopes plan3d costs (attn, moe_router, moe_preprocess, moe under transformer_engine) reach the scenario;
    every CUDA-graph launch gets a note that the graphs' own buffers are not in the memory figures, and the captured parts
    plan3d costs as eager launches are named."""
    r = _check(tmp_path, "megatron_moe.sh", flags)
    assert not r.errors, r.errors
    assert r.scenario.training.cuda_graph_modules == modules
    assert any("not counted in memory" in n for n in r.notes), r.notes
    named = [n for n in r.notes if "eager kernel launches" in n]
    if eager is None:
        assert not named, r.notes
    else:
        assert len(named) == 1 and f"CUDA graphs: {eager} costed" in named[0], r.notes


def test_no_cuda_graph_flag_no_note(tmp_path):
    r = _check(tmp_path, "megatron_moe.sh", "")
    assert r.scenario.training.cuda_graph_modules == ()
    assert not any("CUDA graph" in n for n in r.notes)


@pytest.mark.parametrize("flags, says", [
    ("--enable-cuda-graph --cuda-graph-impl transformer_engine", "Do not use --enable-cuda-graph"),
    ("--external-cuda-graph --cuda-graph-impl local", "Do not use --enable-cuda-graph"),
    ("--enable-cuda-graph --external-cuda-graph", "cannot be enabled at the same time"),
    ("--cuda-graph-impl everything", "none, local or transformer_engine"),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope moe_preprocess", "moe_router"),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope atn", "--cuda-graph-scope atn"),
    # dropless routing: core_v0.16.1 'moe cuda graph is only supported with drop-padding MoE'
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe", "drop-and-pad"),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope moe moe_router", "moe and moe_router"),
    # a capacity without the padding: plan3d reads it as padded, Megatron refuses the whole-layer graph
    ("--moe-expert-capacity-factor 1.0 --cuda-graph-impl transformer_engine --cuda-graph-scope attn moe",
     "without --moe-pad-expert-input-to-capacity"),
    ("--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 --cuda-graph-impl transformer_engine "
     "--cuda-graph-scope moe_router moe_preprocess", "DtoH copies"),
    ("--moe-token-dispatcher-type alltoall --moe-router-padding-for-fp8 --cuda-graph-impl transformer_engine "
     "--cuda-graph-scope moe_router moe_preprocess", "DtoH copies"),
])
def test_cuda_graph_flags_megatron_refuses_are_one_line_errors(tmp_path, flags, says):
    """What Megatron's validate_args asserts (the legacy switches with --cuda-graph-impl, both legacy switches) and
    a scope set plan3d's TrainingSpec refuses as Megatron's help does (moe_preprocess without moe_router) are
    errors naming the flag, never a verdict."""
    r = _check(tmp_path, "megatron_moe.sh", flags)
    assert r.errors and says in r.errors[0], r.errors
    assert "\n" not in r.errors[0]


def test_emitted_cuda_graph_scopes_round_trip_through_check(tmp_path):
    """`plan3d emit megatron` writes a job's cuda_graph_modules as --cuda-graph-impl transformer_engine
    --cuda-graph-scope ... (planner/emit/megatron.py cuda_graph_flags); `check` reads the same modules back, so the
    launch is costed as emitted (before, check dropped them)."""
    model = load_model("tiny-moe")
    sc = Scenario(model=model, hardware=H100,
                  training=TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=1024,
                                        cuda_graph_modules=("attn", "moe_router")),
                  plan=Plan(tp=1, pp=1, dp=8, ep=8, micro_batch_size=1, zero_stage=1))
    (args_file,) = [p for p in write_all(tmp_path, render_all(sc, ["megatron"])) if p.name.endswith(".args")]
    (r,) = check_file_branches(args_file, None, None, None)
    assert not r.errors, r.errors
    assert r.scenario.training.cuda_graph_modules == ("attn", "moe_router")


def test_cp_comm_type_other_than_p2p_is_noted(tmp_path):
    """--cp-comm-type a2a / all_gather / a2a+p2p (TransformerConfig.cp_comm_type) are costed and sized as the p2p
    ring, the only one plan3d models: a note says so; p2p, or any type at cp 1, gets none."""
    base = "megatron_gqa_default.sh"
    r = _check(tmp_path, base, "--context-parallel-size 2 --cp-comm-type a2a")
    assert r.scenario.plan.cp == 2 and any("--cp-comm-type a2a" in n and "p2p ring" in n for n in r.notes), r.notes
    for flags in ("--context-parallel-size 2 --cp-comm-type p2p", "--cp-comm-type all_gather"):
        r = _check(tmp_path, base, flags)
        assert not any("--cp-comm-type" in n for n in r.notes), (flags, r.notes)


def test_capacity_without_padding_is_read_as_padded_with_a_note(tmp_path):
    """Dropping without padding keeps Megatron's per-layer host sync; plan3d's capacity_factor is drop-and-pad, so
    the memory (at capacity) bounds the run and a note says the step time leaves the sync out."""
    r = _check(tmp_path, "megatron_moe.sh", "--moe-expert-capacity-factor 1.25")
    assert not r.errors, r.errors
    assert r.scenario.model.capacity_factor == 1.25
    assert any("without --moe-pad-expert-input-to-capacity" in n for n in r.notes), r.notes
    padded = _check(tmp_path, "megatron_moe.sh", "--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity")
    assert not any("without --moe-pad-expert-input-to-capacity" in n for n in padded.notes), padded.notes
