"""One cost model, one memory model: the search tables hold, for every legal entry, what ``estimate`` says of its
plan (step time to the nanosecond, the fullest stage's memory to the KiB), over jobs that reach the framework
profiles' own branches. A seeded sample of 120 entries per job. A randomized sweep of this kind found two gaps (fixed
2026-12-05): torchtitan's one-micro-batch steps (tests/test_search_single_microbatch.py) and the MoE all-to-all
overlap with activation offloading (tests/test_a2a_overlap.py); and a third (fixed 2026-12-06): the tables took the
first middle stage for the fullest, which a later one can outgrow (search._memory_rows; the job before the last
below). The last job: the all-to-all overlap's exposure depends on the micro-batch count (cost.a2a_alone_share), which
the per-(tp, cp) factors cannot hold; the stage terms apply it per shape."""

import random

import numpy as np
import pytest

from planner.candidates import Pins, SearchSpace
from planner.cost import estimate_time
from planner.memory import estimate_memory
from planner.presets import load_hardware, load_model
from planner.search import INFEASIBLE, KIB, build_tables
from planner.specs import TrainingSpec

JOBS = [  # (model, hardware, job, pins, largest micro-batch, largest cp)
    ("llama3-8b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=32, seq_len=4096, precision="fp8",
                                        grad_reduce_in_bf16=True, fp8_params=True, cross_entropy_fusion="te"),
     Pins(), 2, 2),
    ("llama3-8b", "b200-180gb", dict(num_gpus=16, global_batch_size=16, seq_len=4096, framework="nemo",
                                     precision="mxfp8", optimizer_dtype="bf16", tp_comm_overlap=True), Pins(pp=2), 4, 1),
    ("llama3-8b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=32, seq_len=4096, framework="torchtitan",
                                        compile=True, tp_comm_overlap=True), Pins(), 2, 2),
    ("llama3-70b", "a100-80gb", dict(num_gpus=32, global_batch_size=64, seq_len=2048, framework="deepspeed"), Pins(), 2, 1),
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=16, seq_len=2048, precision="fp8",
                                           fp8_recipe="blockwise"), Pins(ep=8), 1, 1),  # FP8 block scaling's scales
    ("qwen3-30b-a3b", "gb200-nvl72", dict(num_gpus=32, global_batch_size=32, seq_len=2048, moe_a2a_overlap=True,
                                          moe_token_dispatcher="deepep", moe_load_imbalance=1.2,
                                          cuda_graph_modules=("attn", "moe_router")), Pins(ep=8), 4, 1),
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=32, seq_len=2048, framework="torchtitan"),
     Pins(), 2, 2),
    ("tiny-moe", "gb200-nvl72", dict(num_gpus=16, global_batch_size=16, seq_len=1024, moe_a2a_overlap=True,
                                     recompute_modules=("moe_act",)), Pins(pp=1), 4, 1),  # offload offered here
    ("qwen3-30b-a3b", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=16, seq_len=1024, framework="torchtitan"),
     Pins(tp=4), 2, 1),  # steps of one micro-batch
    ("llama3-8b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=32, seq_len=2048, dist_optimizer_instances=2),
     Pins(), 2, 2),  # two copies of the distributed optimizer: ZeRO 1 only, n dividing dp x cp
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=32, seq_len=2048, dist_optimizer_instances=2),
     Pins(ep=8), 1, 1),  # and the expert-data-parallel size
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=32, seq_len=512, framework="nemo",
                                           moe_token_dispatcher="deepep", cuda_graph_modules=("attn",),
                                           recompute_modules=("moe",), grad_reduce_in_bf16=True,
                                           overlap_grad_reduce=False),
     Pins(pp=4), 2, 1),  # a later middle stage fuller than the first: search._memory_rows (2026-12-06)
    ("qwen3-30b-a3b+padded", "b200-180gb", dict(num_gpus=16, global_batch_size=32, seq_len=1024, framework="nemo",
                                                precision="mxfp8", cuda_graph_modules=("attn", "moe")),
     Pins(ep=8), 2, 1),  # drop-and-pad routing with the whole MoE layer in one CUDA graph
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=64, global_batch_size=128, seq_len=2048, moe_a2a_overlap=True),
     Pins(), 2, 1),  # the all-to-all overlap's lone micro-batches: a share of each shape's micro-batches
    ("qwen3-30b-a3b", "gb200-nvl72", dict(num_gpus=128, global_batch_size=128, seq_len=2048),
     Pins(ep=8), 2, 1),  # 128 GPUs of 64-GPU rack segments: build_tables takes the job's NVLink domain as estimate does
    ("qwen3-30b-a3b+padded", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=32, seq_len=2048, framework="nemo",
                                                   moe_token_dispatcher="hybridep"),
     Pins(ep=16), 2, 1),  # HybridEP across two nodes (its RDMA buffers), with drop-and-pad routing, which it takes
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=32, global_batch_size=32, seq_len=2048, optimizer="muon",
                                         grad_reduce_in_bf16=True), Pins(), 2, 2),  # Muon: ZeRO 0, its step copies
    ("qwen3-30b-a3b", "gb200-nvl72", dict(num_gpus=32, global_batch_size=32, seq_len=2048, framework="nemo",
                                          precision="mxfp8", optimizer="dist_muon"),
     Pins(ep=8), 2, 1),  # dist_muon: whole parameters dealt over dp x cp and the expert-data-parallel group
    ("gpt-oss-20b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=16, seq_len=2048, optimizer="dist_muon"),
     Pins(ep=8), 1, 1),  # expert biases and attention sinks: Adam's, in their groups
]


def _model(name: str):
    """A preset, or with "+padded" the preset with drop-and-pad routing (capacity 1.0)."""
    base, _, variant = name.partition("+")
    return load_model(base).model_copy(update={"capacity_factor": 1.0}) if variant == "padded" else load_model(base)


@pytest.mark.parametrize("i", range(len(JOBS)))
def test_tables_are_the_estimate(i):
    name, hw_name, job, pins, mbs, cp = JOBS[i]
    model, hw = _model(name), load_hardware(hw_name)
    tr = TrainingSpec(**job)
    tables = build_tables(model, hw, tr, SearchSpace(pins=pins, max_micro_batch_size=mbs, max_cp=cp))
    legal = np.flatnonzero(tables.legal.ravel())
    assert legal.size >= 20, legal.size
    draw = random.Random(i)
    for k in draw.sample(list(legal), min(legal.size, 120)):
        plan = tables.plan(int(k))
        s, u, z = tables.unindex(int(k))
        t = tables.time_ns[s, u, z]
        if t < INFEASIBLE:
            assert t == pytest.approx(estimate_time(model, hw, tr, plan).step_time_s * 1e9, abs=2.0), plan
        else:  # the zero-bubble schedules are simulated only for entries that fit (search._fill_tables_job)
            assert plan.pipeline_schedule is not None and tables.mem_kib[s, u, z].max() > tables.usable_kib, plan
        peak = max(st.total_bytes for st in estimate_memory(model, hw, tr, plan).stages)
        assert abs(int(tables.mem_kib[s, u, z].max()) * KIB - peak) <= 2 * KIB, plan


SHARED_ROWS = JOBS + [  # a dense job with many splits and virtual stages sharing their stage kinds
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=64, global_batch_size=128, seq_len=4096), Pins(), 2, 2),
    ("llama3-8b", "h100-sxm-80gb", dict(num_gpus=8, global_batch_size=16, seq_len=1024, framework="torchtitan"),
     Pins(tp=1), 2, 1),  # one-micro-batch steps at micro-batch 2 (test_search_single_microbatch): it is in the key
    ("deepseek-v3", "h100-sxm-80gb", dict(num_gpus=128, global_batch_size=128, seq_len=2048), Pins(tp=2, pp=8), 1, 1),
    # splits that spill the dense-first layers onto rank 1 or not: a MoE stage's MoE layers are in the key
]


@pytest.mark.parametrize("i", range(len(SHARED_ROWS)))
def test_shared_stage_rows_change_nothing(i, monkeypatch):
    """search._row_key lets the shapes of a table build share a stage kind's state and DP terms; the tables
    with every row computed anew (each key unique) are the same, bit for bit."""
    from planner import search as S

    name, hw_name, job, pins, mbs, cp = SHARED_ROWS[i]
    model, hw, tr = _model(name), load_hardware(hw_name), TrainingSpec(**job)
    space = SearchSpace(pins=pins, max_micro_batch_size=mbs, max_cp=cp)
    shared = build_tables(model, hw, tr, space, workers=1)
    monkeypatch.setattr(S, "_row_key", lambda *a: (object(),))
    alone = build_tables(model, hw, tr, space, workers=1)
    assert shared.shapes == alone.shapes and shared.legal.any()
    for field in ("time_ns", "mem_kib", "legal"):
        assert np.array_equal(getattr(shared, field), getattr(alone, field)), field
