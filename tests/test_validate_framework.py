"""`plan3d validate --framework`: the frameworks' own logs read back, the run's plumbing, skips, hygiene.

The log fixtures (tests/data/logs) are written by tests/data/logs/make_fixtures.py with the format
strings of Megatron-LM core_v0.16.1 and torchtitan 0.3.0, copied verbatim (file and line there).
The launches here use stand-in ``torchrun`` executables on PATH: no GPU is lent to CI, and both
frameworks need one (the skip tests check the reasons against the installed code).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pytest

from planner.estimate import estimate
from planner.presets import SpecError, load_hardware, load_model
from planner.readers import logs
from planner.specs import Plan, Scenario, TrainingSpec
from planner.validate import framework_run as fr
from planner.validate import launch

DATA = Path(__file__).resolve().parent / "data" / "logs"
GIB, MIB = 2**30, 2**20


def _fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scenario(tp=4, pp=2, dp=1, gpus=8, gbs=128, seq=4096) -> Scenario:
    return Scenario(model=load_model("llama3-8b"), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=gpus, global_batch_size=gbs, seq_len=seq),
                    plan=Plan(tp=tp, pp=pp, dp=dp, micro_batch_size=1))


# --- readers ---------------------------------------------------------------------------------------

def test_megatron_log_reader_on_its_format():
    log = logs.parse_megatron((DATA / "megatron_pretrain_gpt.log").read_text())
    assert [i.iteration for i in log.iterations] == [1, 2, 3, 4, 5]  # the validation line is not an iteration
    assert [i.elapsed_ms for i in log.iterations] == [9876.5, 1234.5, 1250.1, 1229.9, 1240.2]
    assert [i.tflops_per_gpu for i in log.iterations] == [62.5, 501.2, 495.0, 503.3, 498.8]
    assert log.iterations[0].loss == pytest.approx(10.8123) and log.iterations[0].global_batch_size == 128
    assert log.iterations[-1].train_iters == 5 and log.iterations[-1].nan == 0
    assert len(log.memory) == 10 and {m.rank for m in log.memory} == {0, 4}
    last4 = [m for m in log.memory if m.rank == 4][-1]
    # "[Rank 4] (after 5 iterations) memory (MB) | ... | max allocated: 55296.00 | ... | max reserved: 57344.00"
    assert last4.iteration == 5 and last4.max_allocated_bytes == 55296.00 * MIB
    assert last4.max_reserved_bytes == 57344.00 * MIB and last4.allocated_bytes == 31232.00 * MIB
    assert log.theoretical_bytes == {"weight_and_optimizer": 14000.25 * MIB, "activation": 9000.50 * MIB,
                                     "total": 23000.75 * MIB}


def test_megatron_summary_leaves_out_the_warmup_and_keeps_the_peak():
    s = logs.summarize_megatron(logs.parse_megatron((DATA / "megatron_pretrain_gpt.log").read_text()))
    assert s.steps_logged == 5 and s.steps_measured == 4
    assert s.step_time_s == pytest.approx(statistics.median([1.2345, 1.2501, 1.2299, 1.2402]))
    assert s.tflops_per_gpu == pytest.approx(statistics.median([501.2, 495.0, 503.3, 498.8]))
    assert s.memory == {0: {"max_allocated_bytes": 43008.0 * MIB, "max_reserved_bytes": 45056.0 * MIB},
                        4: {"max_allocated_bytes": 55296.0 * MIB, "max_reserved_bytes": 57344.0 * MIB}}


def test_torchtitan_log_reader_with_and_without_colours():
    coloured = logs.parse_torchtitan((DATA / "torchtitan_rank0.log").read_text())
    plain = logs.parse_torchtitan((DATA / "torchtitan_rank1.log").read_text())
    assert [s.step for s in coloured] == [1, 2, 3, 4] == [s.step for s in plain]  # "validate step" left out
    assert [s.tps for s in coloured] == [812, 4101, 4096, 4111]  # "tps: 4,101"
    assert [s.max_reserved_bytes for s in plain] == [x * GIB for x in (58.00, 59.75, 59.80, 59.80)]
    assert coloured[1].loss == 11.75 and coloured[1].grad_norm == 3.2 and coloured[1].tflops == 412.34
    assert coloured[1].mfu_pct == 41.68 and coloured[3].mfu_pct is None  # "mfu: N/A"
    assert coloured[0].max_reserved_pct == 42.99


def test_torchtitan_step_time_from_tps_of_the_slowest_rank():
    per_rank = {r: logs.parse_torchtitan((DATA / f"torchtitan_rank{r}.log").read_text()) for r in (0, 1)}
    tokens = 2 * 8192  # one data-parallel rank's tokens per step
    s = logs.summarize_torchtitan(per_rank, tokens, non_data_parallel_size=2)
    # rank 1's median tps over steps 2-4 is 4100 < rank 0's 4101: tokens / (tps x non-DP size)
    assert s.step_time_s == pytest.approx(tokens / (4100 * 2))
    assert s.steps_measured == 3 and s.tokens_per_s_per_gpu == 4100
    assert s.memory[0]["max_reserved_bytes"] == 61.30 * GIB and s.memory[0]["max_allocated_bytes"] is None


# --- the comparison --------------------------------------------------------------------------------

def megatron_log(sc: Scenario, alloc_factor: float, step_s: float, oom: bool = False) -> str:
    """A Megatron log (its own line formats) whose peaks are ``alloc_factor`` x the predicted stage totals."""
    mk = _fixtures()
    est = estimate(fr.predicted_scenario(sc, "megatron"))
    args = mk.Args()
    lines = []
    for i in range(1, 5):
        lines.append(mk.training_line(args, i, 128 * i, step_s * (5 if i == 1 else 1), 400.0, 1e-4, 128, 10.0, 1.0, 2.0))
        for rank in (0, 4):
            want = est.memory.stages[rank // 4].total_bytes * alloc_factor
            lines.append(mk.memory_line(rank, f"(after {i} iterations)", want / 2, want, want * 1.05, want * 1.05))
    if oom:
        lines.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    return "\n".join(lines)


def test_megatron_run_within_tolerance_passes_and_a_miss_fails():
    sc = scenario()
    predicted_s = estimate(fr.predicted_scenario(sc, "megatron")).time.step_time_s
    ok = fr.compare_logs(sc, "megatron", {None: megatron_log(sc, 1.05, predicted_s * 1.2)}, time_factor=1.5)
    assert ok["verdict"] == "pass", ok["reasons"]
    assert [r["stage"] for r in ok["device_memory"]] == [0, 1]
    assert ok["step_time"]["measured_s"] == pytest.approx(predicted_s * 1.2, rel=1e-3) and ok["step_time"]["judged"]
    low = fr.compare_logs(sc, "megatron", {None: megatron_log(sc, 0.5, predicted_s)})
    assert low["verdict"] == "fail"
    assert any(r.startswith("memory: rank 4 max_memory_allocated") and "-50.0% > 10%" in r for r in low["reasons"])
    slow = fr.compare_logs(sc, "megatron", {None: megatron_log(sc, 1.0, predicted_s * 3)}, time_factor=1.5)
    assert slow["verdict"] == "fail" and any(r.startswith("step time:") for r in slow["reasons"])
    unjudged = fr.compare_logs(sc, "megatron", {None: megatron_log(sc, 1.0, predicted_s * 3)})
    assert unjudged["verdict"] == "pass" and not unjudged["step_time"]["judged"]
    oom = fr.compare_logs(sc, "megatron", {3: "x", None: megatron_log(sc, 1.0, predicted_s, oom=True)})
    assert oom["verdict"] == "fail" and "out of memory: launcher" in oom["reasons"]


def test_torchtitan_reserved_memory_is_judged_one_way():
    sc = scenario(tp=4, pp=1, gpus=4, gbs=8)  # predicted 44.6 GiB: 1.3x still fits 80 GiB
    mk = _fixtures()
    want = estimate(fr.predicted_scenario(sc, "torchtitan")).memory.stages[0].total_bytes

    def text(factor):
        return "\n".join(mk.titan_line(mk.NoColor, i, 10.0, 1.0, want * factor / GIB, 50.0, 5000.0, 400.0, 40.0, "t")
                         for i in (1, 2, 3))

    above = fr.compare_logs(sc, "torchtitan", {0: text(1.3), 1: text(1.3)})
    assert above["verdict"] == "pass" and above["reserved_memory"][0]["rel_error"] == pytest.approx(0.3, abs=0.01)
    below = fr.compare_logs(sc, "torchtitan", {0: text(0.7), 1: text(1.0)})
    assert below["verdict"] == "fail" and len(below["reasons"]) == 1
    assert below["reasons"][0].startswith("memory: rank 0 reserved at most")


def test_no_steps_in_the_logs_is_a_fail():
    out = fr.compare_logs(scenario(), "megatron", {None: "> initializing torch distributed ..."})
    assert out["verdict"] == "fail" and any("no training step" in r for r in out["reasons"])


# --- where it runs ---------------------------------------------------------------------------------

def _no_gpu():
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not importlib.util.find_spec("torchtitan"), reason="torchtitan is not installed")
def test_torchtitan_on_cpu_is_skipped_with_torchtitans_own_reason():
    if not _no_gpu():
        pytest.skip("a GPU is present: torchtitan can run")
    import torch
    from importlib.metadata import version

    root = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])
    pick = next(n for n, ln in enumerate((root / "tools" / "utils.py").read_text().splitlines(), 1)
                if "_get_available_device_type() or \"cuda\"" in ln)
    call = next(n for n, ln in enumerate((root / "trainer.py").read_text().splitlines(), 1)
                if "device_module.set_device(self.device)" in ln)
    run = fr.run_framework(scenario(), "torchtitan", steps=2, timeout_s=60)
    assert run.status == "skipped" and fr.exit_code(run) == fr.SKIP_EXIT_CODE == 77
    reason = run.reasons[0]
    assert reason.startswith(f"torchtitan {version('torchtitan')} cannot train on this machine")
    assert f"torchtitan/tools/utils.py:{pick}" in reason and f"torchtitan/trainer.py:{call}" in reason
    with pytest.raises((AttributeError, AssertionError, RuntimeError)):  # the cited call, here
        torch.cuda.set_device(0)
    assert fr.summary_lines(run) == [f"torchtitan: skipped: {reason}"]


def test_megatron_on_cpu_is_skipped_with_every_reason(monkeypatch, tmp_path):
    if not _no_gpu():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    run = fr.run_framework(scenario(), "megatron", steps=2)
    assert run.status == "skipped" and fr.exit_code(run) == 77
    assert "MEGATRON_LM is not set" in run.reasons[0] and "needs CUDA GPUs" in run.reasons[0]
    (tmp_path / "pretrain_gpt.py").write_text("")
    run = fr.run_framework(scenario(), "megatron", steps=2, megatron_lm=str(tmp_path))
    assert "checkout" not in run.reasons[0] and "needs CUDA GPUs" in run.reasons[0]
    with pytest.raises(SpecError, match="--framework"):
        fr.run_framework(scenario(), "deepspeed")


# --- the launch, with stand-in launchers ----------------------------------------------------------

# torchrun stand-in: record its argv (NUL-separated) and environment, then act as $STAND_IN says
TORCHRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$CAPTURE/argv"
env > "$CAPTURE/env"
case "$STAND_IN" in
  titan) for r in 0 1; do d="$PET_LOG_DIR/job/attempt_0/$r"; mkdir -p "$d"; cp "$FIXTURES/torchtitan_rank$r.log" "$d/stdout.log"; done ;;
  megatron) cat "$FIXTURES/megatron_pretrain_gpt.log" ;;
  hang) setsid sleep 300 & echo $! > "$CAPTURE/worker.pid"; wait ;;
esac
"""


@pytest.fixture
def stand_in(tmp_path):
    bin_dir, capture = tmp_path / "bin", tmp_path / "capture"
    bin_dir.mkdir()
    capture.mkdir()
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)

    def env(mode):
        return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CAPTURE": str(capture), "FIXTURES": str(DATA),
                "STAND_IN": mode}

    return env, capture


def test_torchtitan_launch_runs_the_emitted_script_with_options_torchtitan_accepts(stand_in, tmp_path):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager

    env, capture = stand_in
    sc = scenario(tp=2, pp=1, gpus=2, gbs=8, seq=8192)
    run = fr.run_framework(sc, "torchtitan", steps=3, timeout_s=60, workdir=tmp_path / "run", preflight=False,
                           env=env("titan"))
    argv = (capture / "argv").read_bytes().decode().split("\0")[:-1]
    assert argv[:6] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "-m"] and argv[6] == "torchtitan.train"
    cfg = ConfigManager().parse_args(argv[7:])  # torchtitan's own parser, on what it would receive
    assert cfg.training.steps == 3 + fr.WARMUP_STEPS and cfg.metrics.log_freq == 1
    assert cfg.parallelism.tensor_parallel_degree == 2 and cfg.training.global_batch_size == 8
    assert not cfg.checkpoint.enable and not cfg.validator.enable and cfg.dataloader.dataset == "c4_test"
    assert cfg.metrics.enable_tensorboard and cfg.metrics.save_for_all_ranks and cfg.metrics.save_tb_folder == fr.TB_FOLDER
    assert cfg.dump_folder == str(tmp_path / "run" / "dump")
    seen_env = (capture / "env").read_text()
    assert f"PET_LOG_DIR={tmp_path / 'run' / 'logs'}" in seen_env and "PET_TEE=3" in seen_env
    # the assets load with torchtitan's tokenizer and the c4_test loader (datasets.load_dataset(path, split))
    tok = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)  # as Trainer.__init__ builds it
    ids = tok.encode("w1 w2 w255", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < sc.model.vocab_size and len(ids) == 5
    from datasets import load_dataset

    ds = load_dataset(cfg.dataloader.dataset_path, split="train")
    assert len(ds) == 64 and len(ds[0]["text"].split()) == 512
    # judged from the per-rank log files: tokens per DP rank = 8 x 8192, non-DP size = tp = 2, rank 1 slowest
    assert run.report["step_time"]["measured_s"] == pytest.approx(8 * 8192 / (4100 * 2))
    assert [r["rank"] for r in run.report["reserved_memory"]] == [0, 1]
    assert run.status == run.report["verdict"]


def test_megatron_launch_passes_steps_and_log_options(stand_in, tmp_path):
    env, capture = stand_in
    sc = scenario()
    run = fr.run_framework(sc, "megatron", steps=4, timeout_s=60, preflight=False, env=env("megatron"),
                           megatron_lm="/opt/Megatron-LM")
    argv = (capture / "argv").read_bytes().decode().split("\0")[:-1]
    assert argv[4] == "8" and argv[5] == "/opt/Megatron-LM/pretrain_gpt.py"
    assert argv[-len(fr.MEGATRON_RUN_OPTIONS):] == fr.MEGATRON_RUN_OPTIONS
    assert argv[argv.index("--train-iters") + 1] == str(4 + fr.WARMUP_STEPS)
    assert run.report["step_time"]["measured_s"] == pytest.approx(statistics.median([1.2345, 1.2501, 1.2299, 1.2402]))
    assert {r["rank"]: r["stage"] for r in run.report["device_memory"]} == {0: 0, 4: 1}
    lines = fr.summary_lines(run)
    assert lines[-1 - len(run.reasons)] == f"verdict: {run.status.upper()}"
    assert any(ln.startswith("rank 4 (stage 1): max_memory_allocated 54.000 GiB") for ln in lines)


def test_megatron_accepts_the_run_options(megatron_lm_root, tmp_path, monkeypatch):
    """Megatron-LM core_v0.16.1's own parse_args on the options the run adds."""
    try:
        import megatron.training.arguments as arguments
    except ImportError as err:
        pytest.skip(f"Megatron-LM core_v0.16.1 does not import here ({err})")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                                      "--num-attention-heads", "4", *fr.MEGATRON_RUN_OPTIONS])
    args = arguments.parse_args()
    assert args.log_throughput is True and args.log_memory_interval == 1 and args.eval_iters == 0


def test_timeout_ends_every_process_and_removes_the_folder(stand_in, tmp_path, monkeypatch):
    env, capture = stand_in
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    t0 = time.monotonic()
    run = fr.run_framework(scenario(), "megatron", steps=1, timeout_s=2, preflight=False, env=env("hang"))
    assert time.monotonic() - t0 < 30
    assert run.status == "fail" and run.reasons == ["megatron run timed out after 2 s"] and fr.exit_code(run) == 1
    worker = int((capture / "worker.pid").read_text())  # in its own session, as torchrun's workers are
    for _ in range(50):
        try:
            state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived the timeout")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_emitted_torchtitan_script_passes_options_before_the_subcommand():
    """torchtitan's parser applies options after the activation_checkpoint subcommand to it and refuses
    --training.steps there: the emitted script puts the caller's "$@" first (the run relies on it)."""
    from planner.emit import render_all

    (text,) = render_all(scenario(tp=2, pp=1, gpus=2, gbs=8), ["torchtitan"]).values()
    assert '  "$@" \\\n  activation_checkpoint:none' in text and text.rstrip().endswith("activation_checkpoint:none")


def test_launch_module_judge_is_the_rule_used():
    """The framework report goes through validate's own judge (one rule for both)."""
    sc = scenario()
    out = fr.compare_logs(sc, "megatron", {None: megatron_log(sc, 0.5, 1.0)})
    again, reasons = launch.judge(out, [], launch.MEMORY_TOLERANCE, None)
    assert again == out["verdict"] and reasons == out["reasons"]


def test_judge_logs_of_a_cluster_run(tmp_path):
    """A run made elsewhere, its logs in torchrun's --log-dir layout: judged as the local runs are."""
    for r in (0, 1):
        d = tmp_path / "logs" / "job-1" / "attempt_0" / str(r)
        d.mkdir(parents=True)
        (d / "stdout.log").write_text((DATA / f"torchtitan_rank{r}.log").read_text())
    (tmp_path / "logs" / "job-1" / "attempt_0" / "1" / "stderr.log").write_text("torch.OutOfMemoryError: CUDA out of memory")
    sc = scenario(tp=2, pp=1, gpus=2, gbs=2, seq=8192)
    run = fr.judge_logs(sc, "torchtitan", tmp_path / "logs")
    assert run.report["step_time"]["measured_s"] == pytest.approx(2 * 8192 / (4100 * 2))
    assert run.status == "fail" and "out of memory: rank 1" in run.reasons and fr.exit_code(run) == 1
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "job.out").write_text((DATA / "megatron_pretrain_gpt.log").read_text())
    run = fr.judge_logs(scenario(), "megatron", flat)
    assert {r["rank"] for r in run.report["device_memory"]} == {0, 4}
    with pytest.raises(SpecError, match="--logs"):
        fr.judge_logs(sc, "megatron", tmp_path / "missing")


def test_sigterm_ends_every_process_and_removes_the_folder(stand_in, tmp_path, monkeypatch):
    import threading

    env, capture = stand_in
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def on_start(pid):
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

    with pytest.raises(KeyboardInterrupt):
        fr.run_framework(scenario(), "megatron", steps=1, timeout_s=60, preflight=False, env=env("hang"),
                         on_start=on_start)
    worker = int((capture / "worker.pid").read_text())
    stat = Path(f"/proc/{worker}/stat")
    for _ in range(50):
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived SIGTERM")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_plan_the_emitter_refuses_is_bad_input_not_a_skip():
    sc = Scenario(model=load_model("mistral-7b"), hardware=load_hardware("h100-sxm-80gb"),
                  training=TrainingSpec(num_gpus=8, global_batch_size=64, seq_len=4096),
                  plan=Plan(tp=8, pp=1, dp=1, micro_batch_size=1))
    with pytest.raises(SpecError, match="--emit torchtitan: torchtitan ships no model for mistral-7b"):
        fr.run_framework(sc, "torchtitan")


def test_validate_framework_entry_point(tmp_path, monkeypatch):
    """The CLI's function: a logs folder is judged with the plan's hardware unless one is named; a
    calibrated profile turns the step-time judgement on (launch.time_factor_for, nccl: 1.5x)."""
    (tmp_path / "job.out").write_text((DATA / "megatron_pretrain_gpt.log").read_text())
    run = fr.validate_framework(scenario(), "megatron", logs_dir=str(tmp_path))
    assert not run.report["step_time"]["judged"] and run.report["changed"] == []
    doc = fr.report_json(run)
    assert doc["status"] == run.status and doc["reasons"] == run.reasons and "device_memory" in doc
    calibrated = tmp_path / "local.yaml"
    calibrated.write_text(launch.CALIBRATE_HEADER + " on 2026-11-30, from h100-sxm-80gb.\n"
                          + (Path(__file__).resolve().parents[1] / "hardware_profiles" / "h100-sxm-80gb.yaml").read_text())
    run = fr.validate_framework(scenario(), "megatron", logs_dir=str(tmp_path), hardware_ref=str(calibrated))
    assert run.report["tolerances"]["step_time_factor"] == launch.TIME_FACTOR["nccl"]
    assert run.report["step_time"]["judged"]
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    if _no_gpu():
        assert fr.validate_framework(scenario(), "megatron").status == "skipped"


def test_torchtitan_tensorboard_scalars_judge_active_memory_and_step_time(tmp_path):
    """torchtitan's TensorBoard scalars, written as its TensorBoardLogger writes them
    (``SummaryWriter(log_dir).add_scalar(key, value, step)`` per key of the metrics dict, one folder per
    rank with ``save_for_all_ranks``), then read back: the active peak is judged both ways."""
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed (torchtitan requires it)")
    from torch.utils.tensorboard import SummaryWriter

    sc = scenario(tp=4, pp=1, gpus=4, gbs=8)
    want = estimate(fr.predicted_scenario(sc, "torchtitan")).memory.stages[0].total_bytes
    predicted_s = estimate(fr.predicted_scenario(sc, "torchtitan")).time.step_time_s

    def write(folder, factor, seconds):
        for rank in range(2):
            writer = SummaryWriter(str(folder / "dump" / "tb" / "20261130-1840" / f"rank_{rank}"), max_queue=1000)
            for step in (1, 2, 3, 4):
                metrics = {"loss_metrics/global_avg_loss": 10.0, fr.TB_ACTIVE: want * factor / GIB,
                           "memory/max_reserved(GiB)": want * factor * 1.1 / GIB,
                           fr.TB_STEP_S: seconds * (10 if step == 1 else 1) * (1 + 0.01 * rank + 0.001 * step)}
                for k, v in metrics.items():
                    writer.add_scalar(k, v, step)
            writer.close()
        (folder / "rank0.log").write_text((DATA / "torchtitan_rank1.log").read_text())

    write(tmp_path / "a", 1.04, predicted_s)
    scalars = fr.tensorboard_metrics(tmp_path / "a")
    assert sorted(scalars) == [0, 1] and [s for s, _ in scalars[1][fr.TB_STEP_S]] == [1, 2, 3, 4]
    run = fr.judge_logs(sc, "torchtitan", tmp_path / "a", time_factor=1.5)
    assert [r["metric"] for r in run.report["device_memory"]] == ["max_memory_active"] * 2
    assert run.report["device_memory"][0]["rel_error"] == pytest.approx(0.04, abs=1e-3)
    assert run.report["step_time"]["measured_s"] == pytest.approx(predicted_s * 1.013, rel=1e-4)  # rank 1, step 3
    assert run.report["step_time_source"].startswith("torchtitan TensorBoard")
    assert run.status == "pass", run.reasons
    write(tmp_path / "b", 1.25, predicted_s)
    run = fr.judge_logs(sc, "torchtitan", tmp_path / "b")
    assert run.status == "fail" and run.reasons[0].startswith("memory: rank 0 max_memory_allocated")
