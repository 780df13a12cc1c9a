"""The model states plan3d's Megatron profile counts (planner/frameworks/megatron.py ``state_bytes``) against what
Megatron-Core core_v0.16.1's own ``DistributedDataParallel`` and optimizers hold on four CPU ranks
(tests/megatron_states_probe.py, which names its CUDA stand-ins): per parameter, the bf16 weights, the gradient
buffer, the fp32 master weights and Adam's two states, and the fp32 gradient copies the optimizer makes inside its
step, without and with the distributed optimizer (ZeRO 0 and 1), with fp32 and bf16 gradient buffers, with context
parallelism (the distributed optimizer shards over dp x cp) and with expert parallelism (routed experts shard over
the expert-data-parallel group), in fp16 (``--fp16``: fp16 weights, the grad scaler's optimizers, fp16
gradients unless ``--accumulate-allreduce-grads-in-fp32``), and with two copies of the distributed optimizer
(``--num-distributed-optimizer-instances 2``: each shards over dp x cp / 2). Megatron-FSDP (ZeRO 2/3) is not run here (it needs
CUDA streams and its own buffers throughout). Skips, with the reason, where ../shared is absent."""

import pytest

from planner.frameworks import megatron as mg_profile
from planner.presets import load_model
from planner.specs import Plan, TrainingSpec

pytest.importorskip("torch", reason="Megatron-Core runs on torch")


@pytest.fixture(scope="module")
def megatron_core(megatron_lm_root):
    from tests.subprocess_probe import run_json_probe
    return run_json_probe("tests/megatron_states_probe.py", timeout_s=900, extra_args=[str(megatron_lm_root)])


JOBS = ("zero0-fp32-grads", "zero0-bf16-grads", "zero1-fp32-grads", "zero1-bf16-grads", "zero1-cp2",
        "zero1-ep2-bf16-grads", "zero0-fp16-grads", "zero1-fp16-grads", "zero1-fp16-fp32-grads",
        "zero1-2-instances", "zero1-2-instances-bf16-grads", "zero1-2-instances-ep2")


@pytest.mark.parametrize("job", JOBS)
def test_state_bytes_are_what_megatron_core_holds(megatron_core, job):
    (m,) = [j for j in megatron_core["jobs"] if j["job"] == job]
    n, P = megatron_core["ranks"], megatron_core["params"]
    # --fp16 keeps 16-bit gradients unless --accumulate-allreduce-grads-in-fp32 (plan3d: grad_reduce_in_bf16, 2 B)
    training = TrainingSpec(num_gpus=n, global_batch_size=2 * n, seq_len=8, framework="megatron", fp16=m["fp16"],
                            grad_reduce_in_bf16=not m["fp32_grads"], dist_optimizer_instances=m["instances"])
    experts = m["ep"] > 1
    plan = Plan(tp=1, pp=1, dp=n // m["cp"], cp=m["cp"], micro_batch_size=1,
                zero_stage=1 if m["distributed_optimizer"] else 0, **({"ep": m["ep"], "etp": 1} if experts else {}))
    model = load_model("tiny-moe" if experts else "tiny-gpt")  # bf16 training: no fp8 weight cache looks at it
    layer = megatron_core["width"] ** 2
    st = mg_profile.state_bytes(model, training, plan, P, layer, megatron_core["layers"],
                                expert_params=m["expert_params"])
    assert st.weights_bytes == m["weights"]
    assert st.grads_bytes == m["grads"]
    assert st.optimizer_bytes == m["master"] + m["adam"]
    assert st.step_extra_bytes == m["step_grads"]


def test_megatron_core_holds_the_hand_count(megatron_core):
    """Per parameter over 4 ranks, by hand: bf16 weights 2; gradient buffer 4 (fp32) or 2 (bf16); master 4 and Adam 8,
    whole without the distributed optimizer and over dp x cp = 4 with it, the experts' over their expert-data-parallel
    group of 2; the step's fp32 copies of a bf16 buffer 4, or 4 over the same shards."""
    P = megatron_core["params"]
    got = {j["job"]: tuple(j[k] / P for k in ("weights", "grads", "master", "adam", "step_grads"))
           for j in megatron_core["jobs"]}
    half = 0.5  # the probe marks half its layers as experts
    assert got == {"zero0-fp32-grads": (2, 4, 4, 8, 0), "zero0-bf16-grads": (2, 2, 4, 8, 4),
                   "zero1-fp32-grads": (2, 4, 1, 2, 0), "zero1-bf16-grads": (2, 2, 1, 2, 1),
                   "zero1-cp2": (2, 4, 1, 2, 0),
                   "zero1-ep2-bf16-grads": (2, 2, half * 4 / 4 + half * 4 / 2, half * 8 / 4 + half * 8 / 2,
                                            half * 4 / 4 + half * 4 / 2),
                   # --fp16 (the grad scaler's optimizers): as bf16, byte for byte
                   "zero0-fp16-grads": (2, 2, 4, 8, 4), "zero1-fp16-grads": (2, 2, 1, 2, 1),
                   "zero1-fp16-fp32-grads": (2, 4, 1, 2, 0),
                   # --num-distributed-optimizer-instances 2: each copy shards over 4 / 2 = 2 ranks, the experts' over
                   # their expert-data-parallel group of 2 / 2 = 1 (TrainingSpec.dist_optimizer_instances)
                   "zero1-2-instances": (2, 4, 2, 4, 0), "zero1-2-instances-bf16-grads": (2, 2, 2, 4, 2),
                   "zero1-2-instances-ep2": (2, 2, half * 4 / 2 + half * 4, half * 8 / 2 + half * 8,
                                             half * 4 / 2 + half * 4)}


def test_only_the_first_pipeline_rank_buckets_its_gradients(megatron_core):
    """Megatron's DDP with --overlap-grad-reduce and buckets of two layers: the first pipeline rank's 8 layers make 4
    buckets, reduced as the backward makes them; every later rank holds one bucket, reduced only after its last
    backward (cost.first_stage_buckets_only, which the time model composes by)."""
    from planner.cost import first_stage_buckets_only

    got = {tuple(r) for r in megatron_core["buckets"]}
    assert got == {(0, megatron_core["layers"] // 2), (1, 1)}
    assert first_stage_buckets_only("megatron", 2) and first_stage_buckets_only("nemo", 2)
    assert not first_stage_buckets_only("megatron", 1)


def test_check_names_the_optimizer_step_where_it_sets_the_peak(tmp_path):
    """`plan3d check` on a plan whose peak is Megatron's optimizer step (one GPU, full recompute, bf16 gradients, no
    distributed optimizer): the note says so, by how much, and what shards the copies; with fp32 gradients, none."""
    import json

    from planner.check import check_file_branches
    from planner.memory import GIB, estimate_memory
    from planner.presets import load_hardware
    from planner.specs import Scenario

    model, hw = load_model("llama2-7b"), load_hardware("b200-180gb")
    plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1, recompute="full", zero_stage=0)
    notes, excess = {}, {}
    for bf16 in (True, False):
        tr = TrainingSpec(num_gpus=1, global_batch_size=1, seq_len=2048, grad_reduce_in_bf16=bf16)
        path = tmp_path / f"bf16-{bf16}.plan.json"
        path.write_text(json.dumps(Scenario(model=model, hardware=hw, training=tr, plan=plan).model_dump(mode="json")))
        (result,) = check_file_branches(path, None, None, None)
        notes[bf16] = [n for n in result.notes if "optimizer step" in n]
        excess[bf16] = estimate_memory(model, hw, tr, plan).stages[0].step_excess_bytes / GIB
    assert excess[True] > 0 and excess[False] == 0 and notes[False] == []
    (note,) = notes[True]
    assert note.startswith(f"stage 0's peak is its optimizer step, {excess[True]:.2f} GiB above its backward")
    assert "--use-distributed-optimizer" in note
