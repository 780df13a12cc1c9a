"""Issue 16 item 7: `plan3d validate` runs mixture-of-experts layers with expert parallelism on gloo
(torch's all-to-all) and compares the measured memory of every rank exactly with the prediction.

Four 8-rank gloo runs of tiny-moe (model_specs/tiny-moe.yaml) through ``validate_local``, the entry point
of the other validate tests (module-scoped fixtures, ~15 s each on an idle 2-core machine):

* ``pp2_ep4``: tp1 pp2 dp4 ep4, ZeRO-0: one EP group of 4 per stage, experts not sharded (expert_dp 1);
* ``tp2_ep4_zero3``: tp2 (sequence parallel, etp 1) pp1 dp4 ep4, ZeRO-3, selective recompute, with the
  shared-expert gate and a router bias: EP groups drawn from the tp x dp ranks, router and gate replicated
  over TP, shared experts TP-parallel, experts sharded over expert_dp = tp*dp/ep = 2;
* ``pp2_ep4_padded`` and ``pp2_ep4_dropping``: ``pp2_ep4`` with Megatron-Core's drop-and-pad routing at capacity
  factor 4 (nothing dropped) and 0.5 (half the routed copies dropped).

The single-process checks need no process group: the saved bytes of one MoE layer against the per-tensor
expectation, and the layer's output against a per-token loop over the experts.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from planner.presets import SpecError, load_hardware, load_model  # noqa: E402
from planner.specs import Plan, Scenario, TrainingSpec  # noqa: E402
from planner.validate import launch  # noqa: E402
from planner.memory import stage_param_split  # noqa: E402
from planner.validate.moe import moe_layer_saved_bytes  # noqa: E402

LIMIT_S = 120


def _scenario(model="tiny-moe", **plan):
    base = dict(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1, zero_stage=0)
    m = load_model(model) if isinstance(model, str) else model
    return Scenario(model=m, hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256), plan=Plan(**(base | plan)))


def _validate(sc):
    mini, outcome = launch.validate_local(sc, steps=2, max_ranks=8, timeout_s=LIMIT_S)
    assert outcome.ok, outcome.message
    return mini, outcome.report


@pytest.fixture(scope="module")
def pp2_ep4():
    return _validate(_scenario())


@pytest.fixture(scope="module")
def tp2_ep4_zero3():
    model = load_model("tiny-moe").model_copy(update={"shared_expert_gate": True, "router_bias": True})
    return _validate(_scenario(model, tp=2, pp=1, dp=4, etp=1, sequence_parallel=True, zero_stage=3,
                               recompute="selective"))


@pytest.fixture(scope="module")
def pp2_ep4_padded():
    """Drop and pad to capacity at c 4 (C = T: every expert takes every token, those that did not choose it with
    probability 0): the same routed outputs as dropless, so the single-process reference still applies, with E x T
    copies per rank and no count exchange."""
    return _validate(_scenario(load_model("tiny-moe").model_copy(update={"capacity_factor": 4.0})))


@pytest.fixture(scope="module")
def pp2_ep4_dropping():
    """Drop and pad at c 0.5: each expert keeps C = ceil(128 x 2 / 8 x 0.5) = 16 of the copies each rank routes to
    it, half the balanced load, so at least half of every micro-batch's copies are dropped. Megatron-Core drops per
    rank over the router's own tokens (``apply_router_token_dropping`` on the local batch); the single-process
    reference runs the same micro-batches one by one (``worker._grad_check``), so it drops the same copies."""
    return _validate(_scenario(load_model("tiny-moe").model_copy(update={"capacity_factor": 0.5})))


@pytest.fixture(scope="module")
def pp2_ep4_pattern():
    """Experts in layers 0, 2 and 3 (``moe_layer_pattern`` (1, 0, 1, 1)): rank 0 holds a MoE layer then a dense one."""
    return _validate(_scenario(load_model("tiny-moe").model_copy(update={"first_k_dense": 0,
                                                                       "moe_layer_pattern": (1, 0, 1, 1)})))


RUNS = ["pp2_ep4", "tp2_ep4_zero3"]
PADDED_RUNS = {"pp2_ep4_padded": 4.0, "pp2_ep4_dropping": 0.5}
EXACT_RUNS = RUNS + list(PADDED_RUNS) + ["pp2_ep4_pattern"]
METRICS = {"weights_bytes", "grads_bytes", "optimizer_bytes", "expert_weights_bytes", "expert_grads_bytes",
           "expert_optimizer_bytes", "saved_activation_peak_bytes", "saved_activation_microbatch_bytes"}


@pytest.mark.parametrize("run", EXACT_RUNS)
def test_every_rank_matches_the_prediction_exactly(run, request):
    mini, report = request.getfixturevalue(run)
    assert mini.model.is_moe and mini.plan.ep == 4 and mini.plan.world_size == 8
    assert report["verdict"] == "pass", report["reasons"]
    assert {row["metric"] for row in report["memory"]} == METRICS
    assert len(report["memory"]) == 8 * len(METRICS)
    for row in report["memory"]:
        assert row["rel_error"] == 0.0, row  # bytes, exactly
        assert row["measured"] > 0, row
    experts = {row["rank"]: row["measured"] for row in report["memory"] if row["metric"] == "expert_weights_bytes"}
    weights = {row["rank"]: row["measured"] for row in report["memory"] if row["metric"] == "weights_bytes"}
    assert all(0 < experts[r] < weights[r] for r in weights)


@pytest.mark.parametrize("run", EXACT_RUNS)
def test_the_distributed_moe_computes_what_one_process_computes(run, request):
    """First loss equal to the single-process model's; rank 0's first-step gradients equal the single-process
    gradients of the loss over every replica's batch, for its local experts and for its dense parameters.
    An expert gradient reduced over the wrong group (divided by expert_dp instead of dp) was 4x off here."""
    _, report = request.getfixturevalue(run)
    assert abs(report["reference"]["rel_error"]) <= launch.LOSS_TOLERANCE
    grads = report["moe"]["grad_check"]
    assert grads["expert"]["params"] == 6 and grads["dense"]["params"] > 0  # 2 local experts x 3 matrices
    for g in grads.values():
        assert g["max_abs_grad"] > 0 and g["rel_diff"] <= launch.GRAD_TOLERANCE, g
    losses = report["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("run", RUNS)
def test_tokens_really_moved_between_ranks(run, request):
    """The random router (seed 1234 weights, seed 4321 + dp rank batches) sends each rank's experts a different
    number of tokens; the saved bytes follow the measured counts exactly (above), and differ from the
    balanced-routing expectation by the imbalance, which is reported, not judged."""
    mini, report = request.getfixturevalue(run)
    acts = report["moe"]["activations"]
    assert len(acts) == 8
    balanced = acts[0]["routed_tokens_balanced"]
    # b*s/tp*k of the miniature (s 128, b 1, k 2): every rank's experts get what each rank sends when even
    assert balanced == 128 * 1 // mini.plan.tp * 2
    assert any(a["routed_tokens_min"] < balanced < a["routed_tokens_max"] for a in acts)
    ratios = [a["ratio_to_balanced"] for a in acts]
    print(f"{run}: measured/balanced saved-activation peak per rank: {[round(x, 3) for x in ratios]}; "
          f"routed tokens per MoE layer and micro-batch {min(a['routed_tokens_min'] for a in acts)}.."
          f"{max(a['routed_tokens_max'] for a in acts)} (balanced {balanced})")
    assert all(0.5 < x < 2.0 for x in ratios)
    text = "\n".join(launch.summary_lines(report))
    assert "expert gradients (rank 0, 6 tensors) vs single process" in text and f"balanced {balanced}" in text


@pytest.mark.parametrize("run", PADDED_RUNS)
def test_padded_routing_sends_every_rank_the_same_tokens(run, request):
    """Padded to capacity, every rank's experts receive exactly E x C copies per MoE layer and micro-batch, whatever
    the router does (the dropless runs above differ rank by rank): C = 128 at c 4 (every token, 8 x 128 copies where
    the router asked for 128 x 2), C = 16 at c 0.5 (8 x 16 = 128 of the 256 copies asked for: half dropped)."""
    _, report = request.getfixturevalue(run)
    capacity = {4.0: 128, 0.5: 16}[PADDED_RUNS[run]]  # min(ceil(128 x 2 / 8 x c), 128), by hand
    acts = report["moe"]["activations"]
    assert {a["routed_tokens_min"] for a in acts} == {a["routed_tokens_max"] for a in acts} == {8 * capacity}
    assert all(a["routed_tokens_balanced"] == 8 * capacity for a in acts)


def test_a_wrong_expert_state_or_gradient_fails_the_verdict(pp2_ep4):
    """The verdict reads the measurements: experts whose gradients were not split over EP, or gradients off
    the single-process ones, fail it (same run, measurements edited)."""
    mini, report = pp2_ep4
    measured = copy.deepcopy(report["measured"])
    measured["ranks"][3]["expert_grads_bytes"] *= 4
    measured["ranks"][3]["grads_bytes"] += 3 * measured["ranks"][3]["expert_grads_bytes"] // 4
    measured["ranks"][0]["grad_check"]["expert"]["rel_diff"] = 0.75
    out = launch.compare(mini, measured)
    assert out["verdict"] == "fail"
    assert any("rank 3" in r and "expert_grads_bytes" in r for r in out["reasons"]), out["reasons"]
    assert any(r.startswith("gradients: rank 0's expert gradients") for r in out["reasons"]), out["reasons"]
    assert launch.compare(mini, copy.deepcopy(report["measured"]))["verdict"] == "pass"


def test_parameters_per_rank_by_hand():
    """tiny-moe (h 64, 4 heads of 16, 2 KV heads, SwiGLU, f 256, 8 experts of 128, shared 128, layer 0 dense),
    tp1 pp2 ep4. Attention 64*64 + 2*64*32 + 64*64 = 12288, norms 2*64; dense MLP 3*64*256 = 49152;
    router 8*64 = 512; shared expert 3*64*128 = 24576; one expert 3*64*128 = 24576."""
    sc = _scenario()
    dense_layer, moe_dense = 12288 + 128 + 49152, 12288 + 128 + 512 + 24576
    assert stage_param_split(sc.model, sc.resolved_plan(), 0, 2) == (512 * 64 + dense_layer + moe_dense, 2 * 24576)
    assert stage_param_split(sc.model, sc.resolved_plan(), 1, 2) == (2 * moe_dense + 64 + 512 * 64, 2 * 2 * 24576)


def test_parameters_per_rank_with_tp_by_hand():
    """tiny-moe tp2 (etp 1) pp2 dp2 ep4, stage 0 on one rank: attention 64*(32 + 32) + 32*64 = 6144 (Q and O
    halves, one of the two KV heads), norms 128, dense MLP 64*256 + 128*64 = 24576 (half), router 512 (whole),
    shared expert 64*128 + 64*64 = 12288 (half), vocab-parallel embedding 512*64/2; experts whole, 2 of 8."""
    sc = _scenario(tp=2, dp=2, etp=1, sequence_parallel=True)
    dense_layer, moe_dense = 6144 + 128 + 24576, 6144 + 128 + 512 + 12288
    assert stage_param_split(sc.model, sc.resolved_plan(), 0, 2) == (512 * 64 / 2 + dense_layer + moe_dense, 2 * 24576)


VARIANTS = {
    "swiglu-shared": {},
    "gate-router-bias": {"shared_expert_gate": True, "router_bias": True},
    "gelu-no-shared": {"activation": "gelu", "shared_expert_ffn_hidden_size": None},
    "dropout": {"dropout": True},
    "padded": {"capacity_factor": 1.25},  # drop and pad: 40 slots per expert of 128 tokens x 2 / 8 x 1.25
}
# routed copies of the 2 x 64 tokens: 2 each dropless; 8 experts x ceil(128 x 2 / 8 x 1.25) = 8 x 40 padded
ROUTED = {"padded": 320}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_moe_layer_saves_what_is_expected(variant, recompute):
    """One MoE block in one process (all 8 experts local): the bytes autograd keeps, measured with the
    worker's own saved-tensor hooks, equal the per-tensor expectation for the tokens routed."""
    from planner.validate.model import Block, set_recompute
    from planner.validate.worker import SavedBytes

    model = load_model("tiny-moe").model_copy(update=VARIANTS[variant])
    torch.manual_seed(0)
    blk = Block(model, moe=True)
    if model.shared_expert_gate:
        torch.nn.init.normal_(blk.feed_forward.shared_gate.weight, std=0.02)
    chunk = torch.nn.Module()
    chunk.layers = [blk]
    set_recompute(chunk, recompute)
    training = TrainingSpec(num_gpus=1, global_batch_size=2, seq_len=64, precision="fp32", framework="torch")
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=2, recompute=recompute)
    saved = SavedBytes()
    blk.saved_hooks = saved.context
    blk.feed_forward.on_routed = saved.note_routed
    saved.begin((0, 0))  # what the worker's chunk hooks do around a chunk forward
    out = blk(torch.randn(2, 64, model.hidden_size, requires_grad=True))
    saved.current_key = None
    out.sum().backward()  # full recompute runs the layer again here, outside any chunk forward
    routed = saved.routed[(0, 0)]
    assert routed == [ROUTED.get(variant, 2 * 64 * 2)]  # one process: every routed copy stays here
    assert saved.by_key[(0, 0)] == moe_layer_saved_bytes(model, training, plan, routed[0])


def test_moe_layer_output_equals_a_loop_over_tokens():
    """The sorted dispatch, split, concatenation and scatter_add combine compute, for every token,
    sum over its top-k experts of softmax(top-k logits) * expert(x) + the gated shared expert."""
    from planner.validate.moe_layer import MoE

    model = load_model("tiny-moe").model_copy(update={"shared_expert_gate": True})
    torch.manual_seed(0)
    moe = MoE(model)
    torch.nn.init.normal_(moe.shared_gate.weight, std=0.02)
    x = torch.randn(2, 5, model.hidden_size)
    got = moe(x).reshape(-1, model.hidden_size)
    for t, xt in enumerate(x.reshape(-1, model.hidden_size)):
        logits = xt @ moe.router.weight.T
        top, idx = logits.topk(model.top_k)
        probs = torch.softmax(top, dim=0)
        want = sum(p * moe.experts.experts[str(int(e))](xt[None])[0] for p, e in zip(probs, idx))
        want = want + moe.shared(xt[None])[0] * torch.sigmoid(xt @ moe.shared_gate.weight)
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [0.5, 4.0])
def test_padded_moe_layer_output_equals_a_loop_with_megatrons_drop_rule(capacity_factor):
    """Drop and pad to capacity (core_v0.16.1 moe_utils.apply_router_token_dropping, "probs" policy): each expert keeps
    the C = ceil(T k / E c) tokens of largest routing probability for it, so a token's output sums only the experts
    that kept it. At c 0.5 (C = 2 of 10 tokens) copies are dropped; at c 4 (C = T) none is, and the padding (tokens
    with probability 0) adds nothing."""
    from planner.validate.moe_layer import MoE

    model = load_model("tiny-moe").model_copy(update={"capacity_factor": capacity_factor,
                                                      "shared_expert_ffn_hidden_size": None})
    torch.manual_seed(0)
    moe = MoE(model)
    x = torch.randn(2, 5, model.hidden_size)
    got = moe(x).reshape(-1, model.hidden_size)
    xt = x.reshape(-1, model.hidden_size)
    top, idx = (xt @ moe.router.weight.T).topk(model.top_k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    gate = torch.zeros(10, model.num_experts).scatter(1, idx, probs)
    cap = {0.5: 2, 4.0: 10}[capacity_factor]  # ceil(10 x 2 / 8 x c): ceil(1.25), ceil(10); at most the 10 tokens
    kept = torch.zeros_like(gate, dtype=torch.bool).scatter(0, gate.topk(cap, dim=0).indices, True)
    dropped = 0
    for t in range(10):
        want = torch.zeros(model.hidden_size)
        for e in idx[t].tolist():
            if kept[t, e]:
                want = want + gate[t, e] * moe.experts.experts[str(e)](xt[t][None])[0]
            else:
                dropped += 1
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)
    assert (dropped > 0) is (capacity_factor < 1)


@pytest.mark.parametrize(("model", "update", "plan", "field"), [
    ("tiny-moe", {}, {"etp": 2, "tp": 1}, "etp=2"),
    ("tiny-moe", {}, {"tp": 2, "dp": 2, "etp": 1}, "sequence_parallel"),
    ("deepseek-v3", {"mtp_num_layers": 0}, {}, "MLA"),  # with its MTP module, that refusal comes first
])
def test_what_the_moe_miniature_cannot_run_is_refused_in_one_line(model, update, plan, field):
    m = load_model(model).model_copy(update=update)
    if model == "deepseek-v3":
        sc = Scenario.model_construct(model=m, hardware=load_hardware("h100-sxm-80gb"),
                                      training=TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256),
                                      plan=Plan(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1))
    else:
        sc = Scenario.model_construct(model=m, hardware=load_hardware("h100-sxm-80gb"),
                                      training=TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=256),
                                      plan=Plan(**(dict(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1) | plan)))
    with pytest.raises(SpecError) as err:
        launch.miniature(sc, max_ranks=8)
    text = str(err.value)
    assert "\n" not in text and field in text and text.startswith("validate: ")


def test_the_miniature_keeps_the_experts_and_lists_what_it_changed():
    qwen = load_model("qwen3-30b-a3b")
    sc = Scenario.model_construct(model=qwen, hardware=load_hardware("h100-sxm-80gb"),
                                  training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048),
                                  plan=Plan(tp=1, pp=4, dp=16, ep=8, micro_batch_size=1))
    mini = launch.miniature(sc, max_ranks=8)
    m, p = mini.model, mini.plan
    assert (m.num_experts, m.top_k, p.dp, p.ep) == (8, 2, 2, 2)
    assert m.num_moe_layers > 0 and m.moe_ffn_size % (8 * p.dp) == 0
    changed = " ".join(launch.changes(sc, mini))
    assert f"experts {qwen.num_experts} -> 8" in changed and f"top_k {qwen.top_k} -> 2" in changed
    assert "ep 8 -> 2" in changed
    tiny = launch.miniature(_scenario(), max_ranks=8)
    assert (tiny.model.num_experts, tiny.model.top_k, tiny.model.first_k_dense, tiny.plan.ep) == (8, 2, 1, 4)
    assert not any(c.startswith("mixture of experts") for c in launch.changes(_scenario(), tiny))


def test_the_miniature_keeps_experts_on_every_rank_that_has_them():
    """Maverick at pp 4 x vpp 6 holds one dense and one MoE layer in every chunk; the miniature (one layer a chunk)
    keeps a MoE layer in each, so every rank's expert gradients are checked. The start of the whole pattern
    (0, 1, 0, 1, ...) would have left ranks 0 and 2 with dense layers only."""
    m = load_model("llama4-maverick-17b-128e")
    sc = Scenario.model_construct(model=m, hardware=load_hardware("h100-sxm-80gb"),
                                  training=TrainingSpec(num_gpus=256, global_batch_size=256, seq_len=8192),
                                  plan=Plan(tp=2, pp=4, dp=32, vpp=6, ep=64, etp=1, micro_batch_size=1,
                                            sequence_parallel=True))
    assert all(sc.plan.stage_moe_layers(m))
    mini = launch.miniature(sc, max_ranks=8)
    assert mini.model.moe_layer_pattern == (1,) * 24
    assert all(mini.plan.stage_moe_layers(mini.model))
    # tiny-moe (0, 1, 1, 0) at pp 2 x vpp 2, a layer a chunk: the miniature's two-layer chunks each start with their
    # chunk's layer, so rank 0 keeps its MoE layer in chunk 1 and rank 1 in chunk 0, as the plan has them
    tiny = load_model("tiny-moe").model_copy(update={"first_k_dense": 0, "moe_layer_pattern": (0, 1, 1, 0)})
    small = launch.miniature(_scenario(tiny, pp=2, vpp=2), max_ranks=8)
    assert small.model.moe_layer_pattern == (0, 0, 1, 0, 1, 0, 0, 0)
    assert small.plan.stage_moe_layers(small.model) == (1, 1) == _scenario(tiny, pp=2, vpp=2).plan.stage_moe_layers(tiny)
