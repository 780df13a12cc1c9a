"""The search tables' memory equals the estimate's where a step has one micro-batch (global batch = dp x micro-batch
size). torchtitan's gradient shards exist then only during backward (``optimizer.zero_grad`` frees them between
steps: planner.frameworks.torchtitan.state_bytes), so a stage's states depend on the micro-batch size; the tables took
one micro-batch size's states for all of them until 2026-12-05 (Qwen3-30B-A3B at TP 4 EP 8, micro-batch 2 of a
16-sequence batch on 8 data-parallel ranks: 28.29 GiB in the table, 27.98 in the estimate)."""

import numpy as np
import pytest

from planner.candidates import Pins, SearchSpace
from planner.memory import estimate_memory
from planner.presets import load_hardware, load_model
from planner.search import KIB, build_tables
from planner.specs import TrainingSpec

H100 = load_hardware("h100-sxm-80gb")


@pytest.mark.parametrize("name, gpus, pins", [("qwen3-30b-a3b", 32, Pins(tp=4, ep=8)), ("llama3-8b", 8, Pins(tp=1))])
def test_tables_hold_the_estimate_at_every_micro_batch_size(name, gpus, pins):
    model = load_model(name)
    tr = TrainingSpec(num_gpus=gpus, global_batch_size=16, seq_len=1024, framework="torchtitan")
    tables = build_tables(model, H100, tr, SearchSpace(pins=pins, max_micro_batch_size=2, max_cp=1))
    single = 0
    for k in np.flatnonzero(tables.legal.ravel()):
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        single += tr.global_batch_size == plan.micro_batch_size * plan.dp
        peak = max(st.total_bytes for st in estimate_memory(model, H100, tr, plan).stages)
        assert abs(int(tables.mem_kib[s, u, z].max()) * KIB - peak) <= KIB, plan
    assert single  # the one-micro-batch steps are in the sweep
