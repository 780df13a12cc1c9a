"""Activation offloading to host memory (Plan.cpu_offload_layers; Megatron --cpu-offloading-num-layers).

Oracles: Transformer Engine 2.9's offload handler (``pytorch/cpu_offload.py``,
``AsyncDoubleBufferGroupOffloadHandler``, as Megatron-LM core_v0.16.1 builds it) replayed below step by
step; hand arithmetic; Megatron's own validate_args + TransformerConfig (tests/test_emit_consumers.py).
"""

from __future__ import annotations

import pytest

from planner.cost import estimate_time, layer_time, offload_exposed_s, offload_windows
from planner.memory import estimate_memory, offload_resident_layers
from planner.presets import load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec


def te_window_map(L: int, N: int) -> dict[int, int]:
    """TE 2.9 ``AsyncDoubleBufferGroupOffloadHandler.__init__``, copied: the layer at whose commit group i
    is synchronised (forward: freed after its copy to the host; backward: its reload issued)."""
    layer_window_map, constant = {}, 0
    for i in range(N):
        layer_window_map[i] = ((L // N) * (i + 1)) - 1
        if i < (L % N):
            layer_window_map[i] += i + 1
            constant = i + 1
        else:
            layer_window_map[i] += constant
    return layer_window_map


def te_replay(L: int, N: int) -> tuple[int, list[int], list[int]]:
    """Replays TE's forward and backward commits: (most layers' saved tensors on the GPU at once, layers of
    compute each group's D2H copy overlaps, layers each group's H2D reload overlaps).

    Forward (``synchronize_on_group_commit_forward``): layer j's tensors exist once it ran; group 0's copy
    starts at layer 0's commit; at the commit of ``w[k]`` the compute stream waits for group k's copy,
    frees group k, and starts group k+1's copy. Backward (``on_group_commit_backward``): before layer j's
    backward, if ``j == w[k-1]`` (k = groups still offloaded) the compute stream waits for the reloads
    queued so far and group k-1's reload is issued; at j == 0 it waits for all; layer j's tensors are freed
    by its backward."""
    w = te_window_map(L, N)
    held, peak, count = set(), 0, 0
    d2h_start, d2h_overlap = {0: 0}, {}
    for j in range(L):
        held.add(j)
        peak = max(peak, len(held))
        if count < N and w[count] == j:
            d2h_overlap[count] = j - d2h_start[count]  # layers d2h_start+1 .. j ran beside the copy
            held.discard(count)
            if count + 1 < N:
                d2h_start[count + 1] = j
            count += 1
    issued, h2d_overlap = {}, {}
    for j in range(L - 1, -1, -1):
        if count > 0 and w[count - 1] == j:
            for g in list(issued):  # the compute stream waits for every reload queued so far
                h2d_overlap[g] = issued.pop(g) - j
            issued[count - 1] = j
            held.add(count - 1)
            count -= 1 if count > 1 else 0
        if j == 0:
            for g in list(issued):  # "Last group computation needs to wait till all the reloads complete"
                h2d_overlap[g] = issued.pop(g) - j
        peak = max(peak, len(held))
        held.discard(j)
    return peak, [d2h_overlap[i] for i in range(N)], [h2d_overlap[i] for i in range(N)]


@pytest.mark.parametrize("L", [2, 3, 4, 7, 32, 80, 126])
def test_resident_layers_and_windows_are_transformer_engines(L):
    model = load_model("llama3-8b").model_copy(update={"num_layers": L})
    for N in range(1, L):
        plan = Plan(tp=1, pp=1, dp=1, micro_batch_size=1, cpu_offload_layers=N)
        peak, d2h, h2d = te_replay(L, N)
        assert sum(offload_resident_layers(model, plan, L)) == peak == L - N + 1, (L, N)
        assert list(offload_windows(L, N)) == d2h == h2d, (L, N)
        assert sum(d2h) == L - 1  # layer 0's forward hides no copy: the first starts after it


def test_windows_by_hand():
    # L 7, N 3: L // N = 2, L % N = 1: w = [2*1-1+1, 2*2-1+1, 2*3-1+1] = [2, 4, 6]: windows 2, 2, 2
    assert offload_windows(7, 3) == (2, 2, 2)
    # L 80, N 60: L // N = 1, L % N = 20: w[i] = 2i + 1 for i < 20, i + 20 after: windows 1, 2 x 19, 1 x 40
    assert offload_windows(80, 60) == (1,) + (2,) * 19 + (1,) * 40


def _sc(layers: int, offload: int, **plan) -> Scenario:
    model = load_model("llama3-8b").model_copy(update={"num_layers": layers})
    training = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096)
    return Scenario(model=model, hardware=load_hardware("h100-sxm-80gb"), training=training,
                    plan=Plan(**({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "cpu_offload_layers": offload}
                                 | plan)))


def test_two_layer_toy_memory():
    """A 2-layer model offloading its first layer saves nothing: the layer's copy finishes only at the
    commit of layer 1 (w[0] = 2 // 1 * 1 - 1 = 1), when layer 1's tensors exist too: 2 - 1 + 1 = 2 layers.
    4 layers offloading 3: w = [0, 1, 2, 3] + remainder 1 -> [1, 2, 3]: 4 - 3 + 1 = 2 of 4 layers resident."""
    base2, off2 = (estimate_memory(sc.model, sc.hardware, sc.training, sc.plan).stages[0]
                   for sc in (_sc(2, 0), _sc(2, 1)))
    assert off2.activations_bytes == base2.activations_bytes
    base4, off4 = (estimate_memory(sc.model, sc.hardware, sc.training, sc.plan).stages[0]
                   for sc in (_sc(4, 0), _sc(4, 3)))
    # recompute none: no working set, so the activations are the 4 (2) layers' saved bytes
    assert off4.activations_bytes == pytest.approx(base4.activations_bytes * 2 / 4, rel=1e-12)
    assert off4.activations_bytes < base4.activations_bytes
    assert (off4.weights_bytes, off4.grads_bytes, off4.optimizer_bytes, off4.other_bytes) == \
        (base4.weights_bytes, base4.grads_bytes, base4.optimizer_bytes, base4.other_bytes)


def test_exposed_copy_time_by_hand():
    # L 4, N 2: w = [1, 3]: windows 1, 2 layers. Copies of 1 s, layers of 1 s: 1 - 1 and 1 - 2 -> 0 exposed
    assert offload_windows(4, 2) == (1, 2)
    assert offload_exposed_s(1.0, 1.0, 4, 2) == 0.0
    # a slow link, copies of 3 s: (3 - 1) + (3 - 2) = 3 s exposed per direction
    assert offload_exposed_s(3.0, 1.0, 4, 2) == 3.0


def test_step_time_fast_link_unchanged_slow_link_slower():
    sc0, sc = _sc(32, 16), _sc(32, 16)
    base = estimate_time(sc0.model, sc0.hardware, sc0.training, sc0.plan.model_copy(update={"cpu_offload_layers": 0}))
    fast_hw = sc.hardware.model_copy(update={"host_link_gbps": 1e9})
    fast = estimate_time(sc.model, fast_hw, sc.training, sc.plan)
    assert fast.step_time_s == base.step_time_s  # every copy hides behind its layers
    slow_hw = sc.hardware.model_copy(update={"host_link_gbps": 1.0})
    slow = estimate_time(sc.model, slow_hw, sc.training, sc.plan)
    lt = layer_time(sc.model, sc.hardware, sc.training, sc0.plan.model_copy(update={"cpu_offload_layers": 0}))
    from planner.memory import saved_bytes_per_layer_kind

    x = saved_bytes_per_layer_kind(sc.model, sc.training, sc.plan)[0] / 1e9  # s per copy at 1 GB/s
    assert x > 2 * lt.bwd_compute  # every copy exceeds its window of 2 layers (L 32, N 16: windows 1, 2 x 15)
    # exposed per micro-batch: sum over 16 copies each way of x - window x layer time, windows summing to 31
    m = 16 // 8
    expected = m * (16 * x - 31 * lt.fwd_compute + 16 * x - 31 * lt.bwd_compute)
    assert slow.breakdown["compute"] - base.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    assert slow.step_time_s > base.step_time_s


@pytest.mark.parametrize("plan, field", [
    (dict(pp=2, dp=4), "cpu_offload_layers: Megatron offloads activations only without pipeline parallelism"),
    (dict(recompute="full"), "cpu_offload_layers: Megatron offloads activations only without recomputation"),
])
def test_megatron_rules_in_one_line(plan, field):
    with pytest.raises(ValueError) as err:
        _sc(32, 4, **plan)
    (problem,) = err.value.errors()  # pydantic's wrapper around the plan's own message: one problem, one line
    assert problem["msg"].removeprefix("Value error, ").startswith(field) and len(problem["msg"].splitlines()) == 1


def test_offload_count_below_num_layers_and_framework():
    with pytest.raises(ValueError, match=r"cpu_offload_layers: 32 must be less than num_layers\(32\)"):
        _sc(32, 32)
    sc = _sc(32, 4)
    with pytest.raises(ValueError, match="cpu_offload_layers: torchtitan as plan3d emits it has no activation offloading"):
        Scenario(model=sc.model, hardware=sc.hardware, training=sc.training.model_copy(update={"framework": "torchtitan"}),
                 plan=sc.plan)
    Scenario(model=sc.model, hardware=sc.hardware, training=sc.training.model_copy(update={"framework": "nemo"}),
             plan=sc.plan)  # NeMo passes it on to Megatron-Core


@pytest.mark.parametrize("fmt, match", [("torchtitan", "--emit torchtitan: torchtitan 0.3.0 has no activation"),
                                        ("deepspeed", "--emit deepspeed: the DeepSpeed config written here has no act")])
def test_other_emitters_refuse(fmt, match):
    from planner.emit import render_all
    from planner.errors import SpecError

    sc = _sc(32, 4)
    sc = sc.model_copy(update={"model": load_model("llama3-8b")})
    with pytest.raises(SpecError, match=match):
        render_all(sc, [fmt])


def test_megatron_round_trip(tmp_path):
    from planner.check import check_file
    from planner.emit import render_all
    from planner.memory import estimate_scenario_memory

    model, hw = load_model("llama3-70b"), load_hardware("gb200-nvl72")
    tr = TrainingSpec(num_gpus=64, global_batch_size=256, seq_len=8192, precision="fp8")
    sc = Scenario(model=model, hardware=hw, training=tr,
                  plan=Plan(tp=1, pp=1, dp=64, micro_batch_size=2, zero_stage=3, cpu_offload_layers=40))
    files = render_all(sc, ["megatron", "torchrun"])
    checked = 0
    for name, text in files.items():
        if name.endswith(".plan.json"):
            continue
        path = tmp_path / name
        path.write_text(text)
        assert "--cpu-offloading-num-layers 40" in text
        result = check_file(path, hw, None, None)
        assert not result.errors, result.errors
        assert result.scenario.resolved_plan() == sc.resolved_plan()
        assert estimate_scenario_memory(result.scenario).stages == estimate_scenario_memory(sc).stages
        checked += 1
    assert checked >= 2


def test_search_tables_equal_estimate_with_offload():
    """The search's offload options (pp 1, recompute none: a quarter, half and three quarters of the layers,
    candidates.offload_options) are tabulated by the one cost and memory model: every legal entry equals
    estimate_time and stage_memory of its plan, and none has offloading with pp > 1."""
    from planner.candidates import SearchSpace
    from planner.search import build_tables
    from tests.table_checks import assert_entry_is_estimate, legal_keys

    model, hw = load_model("llama3-8b"), load_hardware("gb200-nvl72")
    tr = TrainingSpec(num_gpus=8, global_batch_size=32, seq_len=8192, precision="fp8")
    tables = build_tables(model, hw, tr, SearchSpace(max_micro_batch_size=4, max_cp=2))
    offs = set()
    for key in legal_keys(tables):
        if not tables.plan(key).cpu_offload_layers:
            continue
        plan = assert_entry_is_estimate(model, hw, tr, tables, key)
        assert plan.pp == 1 and plan.recompute == "none"
        offs.add(plan.cpu_offload_layers)
    assert offs == {8, 16, 24}  # 32 layers: 32 // 4, 32 // 2, 3 * 32 // 4


def test_search_is_exhaustive_optimum_and_offloads_where_recompute_costs_more():
    """CP-SAT over the tables equals the brute force (enumerate_plans + estimate_time/estimate_memory) on a
    job whose activations do not fit without help at pp 1: llama3-8b, 8 GPUs, 16 x 8192-token sequences,
    on a 60 GiB part (the GB200 profile with gpu_memory_gib 60) pinned to tp 1, pp 1, mbs 2."""
    from planner.candidates import Pins, SearchSpace
    from planner.memory import estimate_memory
    from planner.search import exhaustive, search

    model = load_model("llama3-8b")
    hw = load_hardware("gb200-nvl72").model_copy(update={"gpu_memory_gib": 60.0})
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=8192, precision="fp8")
    space = SearchSpace(pins=Pins(tp=1, pp=1, micro_batch_size=2), max_cp=1)
    ref, ref_t, n = exhaustive(model, hw, tr, space)
    res = search(model, hw, tr, space)
    assert res.candidates == n and res.best is not None and ref is not None
    assert estimate_time(model, hw, tr, res.best).step_time_s == pytest.approx(ref_t, rel=1e-9)
    assert estimate_memory(model, hw, tr, res.best).fits
    none = Plan(tp=1, pp=1, dp=8, micro_batch_size=2, zero_stage=res.best.zero_stage)
    assert not estimate_memory(model, hw, tr, none).fits  # the plain plan does not fit ...
    assert res.best.cpu_offload_layers > 0  # ... and offloading beats recomputing here (the link hides the copies)


def test_search_proposes_offloading_only_on_c2c_hosts():
    """On a PCIe host (H100: host_link_gbps 64) the search does not propose CPU offloading; on Grace's
    NVLink-C2C (GB200: 225) it does; a pinned value is searched on either (candidates.offload_options)."""
    from planner.candidates import OFFLOAD_SEARCH_MIN_HOST_LINK_GBPS, Pins, SearchSpace, offload_options

    model = load_model("llama3-8b")
    tr = TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=4096)
    h100, gb200 = load_hardware("h100-sxm-80gb"), load_hardware("gb200-nvl72")
    assert h100.host_link_gbps <= OFFLOAD_SEARCH_MIN_HOST_LINK_GBPS < gb200.host_link_gbps
    assert offload_options(model, h100, tr, SearchSpace(), "none") == (0,)
    assert offload_options(model, gb200, tr, SearchSpace(), "none") == (0, 8, 16, 24)  # 32 layers: 1/4, 1/2, 3/4
    assert offload_options(model, h100, tr, SearchSpace(pins=Pins(cpu_offload_layers=8)), "none") == (8,)


def test_cli_cpu_offload_layers():
    """`--cpu-offload-layers` pins the knob for estimate (the label names it) and is refused in one line with pp > 1."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    job = ["estimate", "--model", "llama3-70b", "--hardware", "gb200-nvl72", "--gpus", "64", "--global-batch", "256",
           "--seq-len", "8192", "--precision", "fp8", "--tp", "1", "--micro-batch-size", "1", "--zero-stage", "3"]
    ok = subprocess.run([sys.executable, "-m", "planner.cli", *job, "--pp", "1", "--cpu-offload-layers", "40", "--json"],
                        capture_output=True, text=True, cwd=root)
    assert ok.returncode in (0, 1), ok.stderr
    assert json.loads(ok.stdout)["plan"]["cpu_offload_layers"] == 40
    bad = subprocess.run([sys.executable, "-m", "planner.cli", *job, "--pp", "2", "--cpu-offload-layers", "40"],
                         capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2 and "cpu_offload_layers" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
