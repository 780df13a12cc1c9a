"""plan3d's DeepSpeed profile against DeepSpeed's own engine (deepspeed 0.19.8, installed by the Makefile), run on
this CPU by tests/deepspeed_engine_probe.py: the optimizer wrapper it picks per ZeRO stage, model kind and
gradient-accumulation dtype (planner.frameworks.deepspeed.wrapper_for), the reduce buffers its ZeRO optimizers
hold (reduce_buffer_count, and the bytes state_bytes counts for them), and its config class's reading of the
``zero_optimization`` keys (planner.readers.megatron.deepspeed_zero_settings)."""

from pathlib import Path

import pytest

from planner.frameworks import deepspeed as ds_profile
from planner.memory import stage_params_per_rank, stage_state_bytes
from planner.presets import SpecError, load_model
from planner.readers.args import Args
from planner.readers.megatron import deepspeed_zero_settings
from planner.specs import DeepSpeedZero, Plan, TrainingSpec

pytest.importorskip("deepspeed")

from tests.deepspeed_engine_probe import BUCKET, ZERO_SECTIONS, run_probe  # noqa: E402

CLASSES = {"DeepSpeedZeroOptimizer": "zero", "DeepSpeedZeroOptimizer_Stage3": "zero",
           "BF16_Optimizer": "bf16_optimizer", "FP16_Optimizer": "fp16_optimizer",
           "FP16_UnfusedOptimizer": "fp16_optimizer"}


@pytest.fixture(scope="module")
def engine():
    return run_probe()


def test_the_optimizer_wrapper_is_the_one_the_engine_picks(engine):
    """Every (model kind, stage, grad_accum_dtype) in bf16: the class the engine builds is the wrapper plan3d costs;
    where the engine refuses, it is one of the two refusals plan3d knows (the pipeline engine's ZeRO 2-3, which
    ``check`` refuses, and ZeRO 0 with an accumulation dtype other than the weights', which it notes)."""
    assert len(engine["wrappers"]) == 2 * 4 * 4
    for pipe, stage, dtype, accum, got in engine["wrappers"]:
        if got.startswith("error"):
            assert (pipe and stage >= 2 and got == "error AssertionError") or \
                (stage == 0 and accum not in (None, dtype) and got == "error NotImplementedError"), (pipe, stage, accum)
            continue
        assert CLASSES[got] == ds_profile.wrapper_for("bf16", False, accum, pipe, stage), (pipe, stage, accum, got)
    picked = {(p, s, a): g for p, s, _, a, g in engine["wrappers"]}
    # the cases that moved plan3d's memory: bf16 ZeRO 0 is FP16_Optimizer without the pipeline engine, and
    # ZeRO 1 with fp32 accumulation is BF16_Optimizer
    assert picked[(False, 0, None)] in ("FP16_Optimizer", "FP16_UnfusedOptimizer")
    assert picked[(True, 0, None)] == picked[(False, 1, "fp32")] == "BF16_Optimizer"


def test_reduce_buffers_are_the_ones_the_engine_holds(engine):
    """Stage 1-3, contiguous_gradients on and off, overlap_comm unset, on and off: the number of reduce buffers the
    engine holds through a backward (each of reduce_bucket_size bf16 elements) is reduce_buffer_count's, and the
    gradient bytes state_bytes counts grow by exactly that many buffers."""
    model = load_model("llama3-8b")
    assert len(engine["buckets"]) == 3 * 2 * 3
    for stage, contiguous, overlap, held in engine["buckets"]:
        overlap = stage == 3 if overlap is None else overlap  # DeepSpeedZeroConfig's default
        training = TrainingSpec(num_gpus=8, global_batch_size=8, seq_len=128, framework="deepspeed",
                                overlap_grad_reduce=overlap,
                                deepspeed=DeepSpeedZero(contiguous_gradients=contiguous, reduce_bucket_elements=BUCKET))
        count = ds_profile.reduce_buffer_count(training, stage)
        assert len(held) == count and all(b == [BUCKET, "torch.bfloat16"] for b in held), (stage, contiguous, overlap)
        plan = Plan(tp=1, pp=1, dp=8, micro_batch_size=1, zero_stage=stage)
        bigger = training.model_copy(update={"deepspeed": training.deepspeed.model_copy(
            update={"reduce_bucket_elements": 10 * BUCKET})})
        grown = stage_state_bytes(model, bigger, plan, 0, 32).grads_bytes - \
            stage_state_bytes(model, training, plan, 0, 32).grads_bytes
        assert grown == pytest.approx(count * 9 * BUCKET * 2)
        assert stage_params_per_rank(model, plan, 0, 32) > 0


def test_the_reader_reads_zero_sections_as_deepspeeds_config_class(engine):
    """deepspeed_zero_settings against DeepSpeedZeroConfig on the same sections: contiguous_gradients,
    reduce_bucket_size, stage3_prefetch_bucket_size, overlap_comm's stage-dependent default and the ZeRO-3
    coordinator's stage3_max_live_parameters, stage3_max_reuse_distance and stage3_param_persistence_threshold."""
    a = Args(path=Path("run.sh"))
    assert [s for s, _ in engine["zero_config"]] == ZERO_SECTIONS
    for section, want in engine["zero_config"]:
        settings, overlap = deepspeed_zero_settings(a, {"zero_optimization": section})
        assert (settings["contiguous_gradients"], settings["reduce_bucket_elements"],
                settings["prefetch_bucket_elements"], overlap, settings["max_live_elements"],
                settings["max_reuse_elements"], settings["persistence_threshold_elements"]) == \
            (want["contiguous_gradients"], want["reduce_bucket_size"], want["prefetch_bucket_size"],
             want["overlap_comm"], want["max_live_parameters"], want["max_reuse_distance"],
             want["param_persistence_threshold"]), section


@pytest.mark.parametrize("section, field", [({"reduce_bucket_size": "5e8"}, "reduce_bucket_size"),
                                             ({"reduce_bucket_size": 0}, "reduce_bucket_size"),
                                             ({"reduce_bucket_size": 1.5}, "reduce_bucket_size"),
                                             ({"contiguous_gradients": "maybe"}, "contiguous_gradients"),
                                             ({"overlap_comm": 2}, "overlap_comm"),
                                             ({"stage3_prefetch_bucket_size": -1}, "stage3_prefetch_bucket_size"),
                                             ({"stage3_max_live_parameters": -5}, "stage3_max_live_parameters"),
                                             ({"stage3_max_reuse_distance": "far"}, "stage3_max_reuse_distance")])
def test_values_deepspeed_refuses_are_one_line_errors(section, field):
    """What DeepSpeedZeroConfig rejects is refused with the key named."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DeepSpeedZeroConfig(**section)
    with pytest.raises(SpecError, match=f"zero_optimization.{field}"):
        deepspeed_zero_settings(Args(path=Path("run.sh")), {"zero_optimization": section})


def test_gradient_accumulation_passes_are_the_ones_the_engine_runs(engine):
    """The memory-bound passes plan3d charges each micro-batch's backward under DeepSpeed
    (``frameworks.deepspeed.grad_accum_passes``, ``cost.grad_accum_s``) are the ones the engine runs: per optimizer
    wrapper, the operations on parameter-sized tensors besides the GEMMs of a steady micro-batch, with the bytes
    each reads and writes per parameter element (BF16_Optimizer: the 16-bit gradients zeroed, autograd's add into
    them, the add into its accumulation buffer with a cast where that buffer is fp32; FP16_Optimizer and ZeRO 1:
    autograd's add alone; ZeRO 2 and 3: the bucket's copy and average whole, the partition's copies and add over
    1 / N), on one rank and, for ZeRO 2 and 3, on two and four; and under the pipeline engine with a stage per rank,
    where the stages before the last zero BF16_Optimizer's gradients twice."""
    cases = [(1, 0, case) for case in engine["accumulation"]] + \
        [(int(n), rank, case) for n, ranked in engine["accumulation_ranks"].items()
         for rank, cases_of_rank in enumerate(ranked) for case in cases_of_rank]
    assert len(cases) == 6 + 2 * 3 + 4 * 3
    for ranks, rank, (pipe, stage, accum, wrapper, buffer_dtype, measured) in cases:
        buffer = {"bfloat16": "bf16", "float32": "fp32", None: accum}[buffer_dtype]  # the buffer the engine made
        training = TrainingSpec(num_gpus=ranks, global_batch_size=8 * ranks, seq_len=16, framework="deepspeed",
                                deepspeed={"pipeline_engine": pipe, "grad_accum_dtype": buffer})
        pp = ranks if pipe else 1  # the probe's pipeline has a stage per rank, else the ranks shard the gradients
        plan = Plan(tp=1, pp=pp, dp=ranks // pp, micro_batch_size=2, zero_stage=stage)
        last = rank == pp - 1
        assert ds_profile.optimizer_wrapper(training, stage, pp) == CLASSES[wrapper]
        ours: dict = {}
        for name, read, written, partition in ds_profile.grad_accum_passes(training, stage, pp, last):
            share = 1 / plan.dp if partition else 1
            r, w = ours.get(name, (0, 0))
            ours[name] = (r + read * share, w + written * share)
        assert sorted([name, float(r), float(w)] for name, (r, w) in ours.items()) == measured, \
            (wrapper, accum, ranks, rank)
        assert ds_profile.grad_accum_bytes_per_param(training, plan, last) == sum(r + w for _, r, w in measured)
