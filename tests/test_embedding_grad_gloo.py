"""torchtitan's TP word embedding's weight gradient, measured on the real library with real tensors (gloo ranks:
tests/embedding_grad_probe.py), against what plan3d charges for it (``planner.frameworks.torchtitan``
``embedding_grad_bytes`` and ``embedding_accumulator_extra_bytes``, and the allocator trace's first stage).

torchtitan shards the embedding's rows over TP (``RowwiseParallel``), but DTensor has no backward strategy that
makes a row-sharded weight gradient (torch 2.13 ``_embedding_ops.py``, ``embedding_dense_backward_strategy``):
every rank computes the gradient of every row, t times its shard. FSDP2 redistributes it to the rank's rows when it
reduces (``_get_grad_inner_tensor``); under PP it first upcasts it whole into its fp32 accumulator. Before
2026-12-04 plan3d charged the rows only: a torchtitan first stage at TP 8 read 45-52 % below torch's own trace
(tests/test_torchtitan_reserved.py).

A few seconds per job on a 2-core machine.
"""

from pathlib import Path

import pytest

pytest.importorskip("torch")

from planner.frameworks.torchtitan import embedding_accumulator_extra_bytes, embedding_grad_bytes  # noqa: E402
from planner.specs import Plan, TrainingSpec  # noqa: E402
from tests.embedding_grad_probe import HIDDEN, VOCAB  # noqa: E402
from tests.torchrun_jobs import probe_json  # noqa: E402

PROBE = Path(__file__).parent / "embedding_grad_probe.py"
LIMIT_S = 300
TPS = (2, 4)
TRAINING = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=256, framework="torchtitan")


@pytest.fixture(scope="module")
def measured() -> dict:
    return {tp: probe_json(PROBE, tp, LIMIT_S) for tp in TPS}


@pytest.mark.parametrize("tp", TPS)
def test_every_rank_holds_the_whole_vocabularys_gradient(measured, tp):
    m = measured[tp]
    assert m["rows"] == VOCAB // tp
    assert m["grad_local_shape"] == [VOCAB, HIDDEN]
    assert m["largest_backward_tensor_bytes"] == VOCAB * HIDDEN * m["grad_element_bytes"]


@pytest.mark.parametrize("tp", TPS)
def test_charged_gradient_is_the_measured_one(measured, tp):
    m = measured[tp]
    rows = m["rows"] * HIDDEN  # this rank's parameters of the embedding
    pipelined = Plan(tp=tp, pp=2, dp=1, micro_batch_size=1, zero_stage=3)
    # under PP the whole-vocabulary bf16 gradient is what the backward makes, then upcast whole (fp32 accumulator)
    assert embedding_grad_bytes(TRAINING, pipelined, rows) == m["largest_backward_tensor_bytes"]
    assert embedding_accumulator_extra_bytes(TRAINING, pipelined, rows) == 4 * (VOCAB * HIDDEN - rows)
    # without PP FSDP2's post_backward also makes this rank's rows before the whole gradient goes
    single = Plan(tp=tp, pp=1, dp=1, micro_batch_size=1, zero_stage=3)
    assert embedding_grad_bytes(TRAINING, single, rows) == m["largest_backward_tensor_bytes"] + 2 * rows
