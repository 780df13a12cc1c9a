"""DeepSpeed's pipeline engine, run on this CPU (tests/deepspeed_pipe_probe.py: gloo ranks, DeepSpeed 0.19.8's own
``PipelineEngine`` and ``TrainSchedule``), against the boundary tensors plan3d counts for it
(``planner.memory.deepspeed_pipe_tensor_counts``).

The probe reports, per rank at its peak, what the engine references, by where it keeps it. Two of those are not
extras and the estimator counts them elsewhere: the last stage's current module output (the loss stage's output
term) and, under model parallelism, the gathered input the model runs on (its first layer saves it). The rest
must equal the counts, in stage-boundary tensors (the probe's blocks map ``h -> h``, so its last module output is
one boundary too)."""

from __future__ import annotations

import numpy as np
import pytest

from planner.memory import deepspeed_pipe_bytes, deepspeed_pipe_tensor_counts, kept_output_bytes
from planner.presets import load_model
from planner.specs import Plan, TrainingSpec
from tests.deepspeed_pipe_probe import CASES
from tests.subprocess_probe import run_json_probe

PROBE = "tests/deepspeed_pipe_probe.py"


@pytest.fixture(scope="module")
def measured():
    return run_json_probe(PROBE, timeout_s=900)


@pytest.mark.parametrize("pp,m,tp", CASES, ids=[f"pp{p}-m{m}-tp{t}" for p, m, t in CASES])
def test_engine_holds_what_plan3d_counts(measured, pp, m, tp):
    plan = Plan(tp=tp, pp=pp, dp=1, micro_batch_size=1)
    whole, sent, kept = deepspeed_pipe_tensor_counts(plan, m, np.arange(pp))
    for rank in measured[f"pp{pp}_m{m}_tp{tp}"]:
        r, held = rank["stage"], rank["at_peak"]
        extra = (held.get("outputs", 0.0) - (1.0 if r == pp - 1 else 0.0) + held.get("recv_buf", 0.0)
                 + held.get("grad_layer", 0.0) + (held.get("inputs", 0.0) if tp == 1 else 0.0))
        assert extra == pytest.approx(whole[r] + sent[r] / tp + kept[r]), (r, held)
        assert rank["in_flight"] == min(pp - r, m)  # TrainSchedule's micro-batches in flight


def test_deepspeed_pipe_bytes_by_hand():
    """Llama-3-8B shapes under Megatron-DeepSpeed, PP 4, TP 1, 8 micro-batches of 1 x 4096 (boundary 4096 x 4096 x 2 B
    = 32 MiB): rank 1 keeps 3 received inputs, 3 outputs and its receive buffer (7 boundaries); the last stage its
    received input, its receive buffer and the previous micro-batch's fp32 logits (4096 x 128256 x 4 B)."""
    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=4, global_batch_size=8, seq_len=4096, framework="deepspeed")
    plan = Plan(tp=1, pp=4, dp=1, micro_batch_size=1)
    boundary = 4096 * 4096 * 2
    assert deepspeed_pipe_bytes(model, tr, plan, 8, 1) == 7 * boundary
    assert deepspeed_pipe_bytes(model, tr, plan, 8, 3) == 2 * boundary + 4096 * 128256 * 4
    assert kept_output_bytes(model, tr, plan) == 4096 * 128256 * 4
    # Megatron's schedules keep none of these (memory.megatron_p2p_bytes counts theirs)
    assert deepspeed_pipe_bytes(model, tr.model_copy(update={"framework": "megatron"}), plan, 8, 1) == 0.0
