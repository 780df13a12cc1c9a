"""The "no plan fits" answer's smallest cluster: ``search.any_plan_fits`` (the search's verdict from memory-only
tables) agrees with ``search.search``, the memory-only tables are the full tables' memory and legality bit for bit,
and ``smallest_fitting_gpus`` returns a count the search fits, with the count below it in its steps not fitting."""

import numpy as np
import pytest

from planner import search as S
from planner.candidates import Pins, SearchSpace, switch_options
from planner.presets import load_hardware, load_model
from planner.specs import TrainingSpec

JOBS = [  # (model, hardware, job, pins, offer the job switches both ways)
    ("gpt3-175b", "a100-80gb", dict(num_gpus=32, global_batch_size=8, seq_len=2048), Pins(), True),
    ("gpt3-175b", "a100-80gb", dict(num_gpus=40, global_batch_size=8, seq_len=2048), Pins(), True),
    ("gpt3-175b", "a100-80gb", dict(num_gpus=64, global_batch_size=8, seq_len=2048), Pins(recompute="none"), True),
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=8, global_batch_size=64, seq_len=8192), Pins(), False),
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=64, seq_len=8192), Pins(tp=8), True),
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=16, global_batch_size=64, seq_len=8192, framework="torchtitan"),
     Pins(), False),  # torchtitan judges by the replayed reserved peak (search.reference_fits)
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=8, global_batch_size=64, seq_len=4096), Pins(), True),
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=4, global_batch_size=64, seq_len=4096), Pins(ep=4), True),
]


def _job(i):
    name, hw_name, job, pins, offer = JOBS[i]
    model, hw, training = load_model(name), load_hardware(hw_name), TrainingSpec(**job)
    space = SearchSpace(pins=pins, **(switch_options(training, None, None) if offer else {}))
    return model, hw, training, space


@pytest.mark.parametrize("i", range(len(JOBS)))
def test_any_plan_fits_agrees_with_the_search(i):
    model, hw, training, space = _job(i)
    assert S.any_plan_fits(model, hw, training, space) == (S.search(model, hw, training, space).best is not None)


def test_the_jobs_cover_both_answers():
    answers = {S.search(*_job(i)).best is not None for i in range(len(JOBS))}
    assert answers == {True, False}


@pytest.mark.parametrize("i", [0, 4, 7])
def test_memory_only_tables_are_the_full_tables_memory(i):
    model, hw, training, space = _job(i)
    hw = hw.for_job(training.num_gpus)
    full = S.build_tables(model, hw, training, space)
    light = S.build_tables(model, hw, training, space, memory_only=True)
    assert full.shapes == light.shapes and full.micros == light.micros and full.zeros == light.zeros
    assert np.array_equal(full.legal, light.legal) and np.array_equal(full.mem_kib, light.mem_kib)
    assert (light.time_ns == S.INFEASIBLE).all() and (full.time_ns[full.legal] < S.INFEASIBLE).any()


@pytest.mark.parametrize("name, hw_name, job, pins", [
    ("gpt3-175b", "a100-80gb", dict(num_gpus=8, global_batch_size=8, seq_len=2048), Pins()),
    ("llama3-70b", "h100-sxm-80gb", dict(num_gpus=1, global_batch_size=64, seq_len=8192), Pins()),  # no gap left
    ("llama2-13b", "a100-40gb", dict(num_gpus=1, global_batch_size=60, seq_len=4096), Pins()),  # steps of 1 GPU
    ("mixtral-8x7b", "h100-sxm-80gb", dict(num_gpus=2, global_batch_size=64, seq_len=4096), Pins(ep=2)),
])
def test_smallest_fitting_gpus_is_a_count_the_search_fits(name, hw_name, job, pins):
    model, hw, training = load_model(name), load_hardware(hw_name), TrainingSpec(**job)
    space = SearchSpace(pins=pins, **switch_options(training, None, None))

    def fits(n):
        return S.search(model, hw, training.model_copy(update={"num_gpus": n}), space).best is not None

    assert not fits(training.num_gpus)
    got = S.smallest_fitting_gpus(model, hw, training, space)
    assert got is not None and got.start == training.num_gpus
    assert fits(got.gpus) and not fits(got.low)
    assert got.low < got.gpus <= 2 * got.low and got.low % training.num_gpus == 0
    assert got.gpus == 2 * got.low or (got.step and (got.gpus - got.low) % got.step == 0)
    if got.step and got.gpus - got.step > got.low:  # the count just below it in its steps does not fit
        assert not fits(got.gpus - got.step)
    if name == "llama2-13b":  # 8 fits, 4 does not; below a node the gap is walked GPU by GPU
        assert (got.low, got.step) == (4, 1)
    assert got.describe().startswith(f"the smallest GPU count that fits is {got.gpus} (tried {got.start} x 2^k")


def test_smallest_fitting_gpus_none_when_nothing_fits():
    model, hw = load_model("gpt3-175b"), load_hardware("a100-80gb")
    training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=2048)
    assert S.smallest_fitting_gpus(model, hw, training, SearchSpace(pins=Pins(tp=1, pp=1)), max_doublings=3) is None
