"""The model states plan3d's DeepSpeed profile counts (planner/frameworks/deepspeed.py ``state_bytes``) against what
DeepSpeed 0.19.8's ZeRO optimizers hold on four CPU ranks (tests/deepspeed_states_probe.py): per parameter, the
16-bit weights, the 16-bit gradients between micro-batches, the fp32 gradient partition the wrapped Adam steps on,
the fp32 master partition and Adam's two states, at ZeRO stages 0 (bf16 without a pipeline: FP16_Optimizer), 1, 2
and 3. ZeRO-3's gathered weights and the
gathered module's gradient are DeepSpeed's coordinator's (tests/test_deepspeed_zero3.py) and are taken out here."""

import pytest

from planner.frameworks import deepspeed as ds_profile
from planner.presets import load_model
from planner.specs import DeepSpeedZero, Plan, TrainingSpec

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def engine():
    from tests.subprocess_probe import run_json_probe
    return run_json_probe("tests/deepspeed_states_probe.py", timeout_s=900)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_are_what_the_zero_optimizer_holds(engine, stage):
    (measured,) = [s for s in engine["stages"] if s["stage"] == stage]
    n, P, layer = engine["ranks"], engine["params"], engine["width"] ** 2
    training = TrainingSpec(num_gpus=n, global_batch_size=2 * n, seq_len=8, framework="deepspeed",
                            deepspeed=DeepSpeedZero(contiguous_gradients=False))
    plan = Plan(tp=1, pp=1, dp=n, micro_batch_size=1, zero_stage=stage)
    model = load_model("tiny-gpt")  # only ZeRO-3's gathered weights look at the model; taken out below
    st = ds_profile.state_bytes(model, training, plan, P, layer, engine["layers"])
    gathered = 2 * ds_profile.zero3_gathered_elements(model, plan, training.deepspeed) if stage == 3 else 0
    working = 2 * layer if stage == 3 else 0  # the gradient of one gathered layer, before its reduce-scatter
    assert (st.weights_bytes - gathered) / P == pytest.approx(measured["weights"])
    assert (st.grads_bytes - working) / P == pytest.approx(measured["bf16_grads"] + measured["fp32_grads"])
    assert st.optimizer_bytes / P == pytest.approx(measured["master"] + measured["adam"])
    # by hand, per parameter over n = 4 ranks: 16-bit weights 2 (stage 3: 2/4), 16-bit gradients 2 at stages 0-1
    # (kept whole until the step's last micro-batch reduces them) and 2/4 at stages 2-3, fp32 gradients 4/4, master
    # 4/4, Adam 8/4; stage 0 (FP16_Optimizer) shards nothing
    shard = 1.0 if stage == 0 else 1 / n
    assert (measured["weights"], measured["bf16_grads"], measured["fp32_grads"], measured["master"],
            measured["adam"]) == ((2.0 if stage < 3 else 0.5), (2.0 if stage <= 1 else 0.5), 4 * shard, 4 * shard,
                                  8 * shard)
