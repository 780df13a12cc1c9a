"""torchtitan's loss under ``loss_parallel``, measured on the real library with real tensors (gloo ranks, torch's
``MemTracker``: tests/loss_parallel_probe.py), against the bytes per logit plan3d charges it
(``planner.frameworks.torchtitan.LOSS_PARALLEL_BYTES_PER_ELEMENT``) and against plan3d's fake-tensor harness
(``planner.fake_rank.measure_loss_bytes``), which the allocator trace's recorded loss comes from.

* the loss's memory per rank falls as 1/tp: the bytes per *local* logit do not grow with the TP degree (no tensor
  over the whole vocabulary on a rank);
* the charged figure is what the real library allocates, and so is the fake harness's: before it ran DTensor's
  sharding propagation in a fake mode of its own (``fake_rank._dtensor_propagation_apart``) it counted the
  propagation's global-shape tensors as the rank's, 22, 38 and 70 B per local logit at tp 2, 4 and 8, where real
  ranks allocate 16 at every tp.

A few seconds per job on a 2-core machine.
"""

from pathlib import Path

import pytest

pytest.importorskip("torch")

from planner import fake_rank  # noqa: E402
from planner.frameworks.torchtitan import LOSS_PARALLEL_BYTES_PER_ELEMENT  # noqa: E402
from tests.loss_parallel_probe import BATCH, SEQ, VOCAB  # noqa: E402
from tests.torchrun_jobs import probe_json  # noqa: E402

PROBE = Path(__file__).parent / "loss_parallel_probe.py"
LIMIT_S = 300
TPS = (1, 2, 8)


@pytest.fixture(scope="module")
def measured() -> dict:
    out = {}
    for tp in TPS:
        first, second = probe_json(PROBE, tp, LIMIT_S)["bytes_per_local_logit"]
        assert first == pytest.approx(second, rel=1e-6)  # nothing cached by the first pass changes the second
        out[tp] = second
    return out


def test_loss_memory_per_rank_falls_as_one_over_tp(measured):
    assert measured[8] == pytest.approx(measured[2], rel=0.02)
    assert measured[2] == pytest.approx(measured[1], rel=0.02)


@pytest.mark.parametrize("tp", TPS)
def test_charged_bytes_per_logit_are_the_real_librarys(measured, tp):
    assert LOSS_PARALLEL_BYTES_PER_ELEMENT == pytest.approx(measured[tp], rel=0.02)


@pytest.mark.parametrize("tp", [2, 8])
def test_fake_harness_counts_what_real_ranks_allocate(measured, tp):
    tokens = BATCH * SEQ
    fake = fake_rank.measure_loss_bytes(tokens, VOCAB, tp) / (tokens * VOCAB / tp)
    assert fake == pytest.approx(measured[tp], rel=0.02)
