"""Emitted launch files run through their consumers' own startup checks, and hostile model names.

* Names: a model name (from YAML or a Hugging Face ``_name_or_path``) may hold ``/``, ``..``, quotes,
  ``$(...)``, backquotes or newlines. Emitted files must land inside the output folder, pass
  ``bash -n`` and ``shellcheck``, and running them (with stand-in ``torchrun``/``srun``/``scontrol``
  that only record their argv) must run nothing from the name.
* Megatron-LM core_v0.16.1 (the tarball in ``../shared/consumers``): the argv that the emitted
  torchrun and Slurm scripts actually pass (captured by the stand-ins) goes through Megatron's own
  ``parse_args``, ``validate_args`` (with ``pretrain_gpt.py``'s ``args_defaults``), the model-config
  build ``core_transformer_config_from_args`` and the micro-batch calculator; the layers Megatron
  builds on each (pipeline rank, virtual stage) must be the plan's.
* torchtitan 0.3.0: ``ConfigManager`` (which runs ``Trainer.Config.__post_init__``), the model config's
  ``update_from_config`` (tp against the heads and KV heads, weight tying under PP, sequence length),
  ``ParallelDims`` validation, and the batch and pipeline-split checks of ``Trainer.__init__``/``pipeline_llm``
  that need no GPU.
* DeepSpeed: ``DeepSpeedConfig`` and the pipeline engine's ZeRO constraint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.emit import render_all
from planner.io import write_all
from planner.names import slug
from planner.presets import SpecError, load_hardware, load_model
from planner.specs import Plan, Scenario, TrainingSpec, chunk_split, plan_problems

# pretrain_gpt.py (core_v0.16.1) calls pretrain(..., args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}).
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def scenario(model: str, gpus: int, global_batch: int, seq_len: int, precision: str = "bf16",
             hardware: str = "h100-sxm-80gb", name: str | None = None, tp_comm_overlap: bool | None = None,
             overlap_p2p_comm: bool | None = None, fp8_params: bool = False, cross_entropy_fusion: str = "none",
             optimizer_dtype: str = "fp32", fp16: bool = False, grad_reduce_in_bf16: bool = False,
             distribute_saved_activations: bool = False, dist_optimizer_instances: int = 1,
             fp8_recipe: str = "delayed", **plan) -> Scenario:
    m = load_model(model)
    if name is not None:
        m = m.model_copy(update={"name": name})
    return Scenario(model=m, hardware=load_hardware(hardware),
                    training=TrainingSpec(num_gpus=gpus, global_batch_size=global_batch, seq_len=seq_len,
                                          precision=precision, tp_comm_overlap=tp_comm_overlap,
                                          overlap_p2p_comm=overlap_p2p_comm, fp8_params=fp8_params,
                                          cross_entropy_fusion=cross_entropy_fusion, optimizer_dtype=optimizer_dtype,
                                          fp16=fp16, grad_reduce_in_bf16=grad_reduce_in_bf16,
                                          distribute_saved_activations=distribute_saved_activations,
                                          dist_optimizer_instances=dist_optimizer_instances, fp8_recipe=fp8_recipe),
                    plan=Plan(**({"micro_batch_size": 1} | plan)))


# --- stand-in launchers ---------------------------------------------------------------------------
STAND_INS = {
    # torchrun: record argv (NUL-separated) and CUDA_DEVICE_MAX_CONNECTIONS as the ranks would see it
    "torchrun": """#!/usr/bin/env bash
f="$(mktemp "$PLAN3D_CAPTURE/call.XXXXXX")"
printf '%s\\0' "$@" > "$f.argv"
printf '%s' "${CUDA_DEVICE_MAX_CONNECTIONS-<unset>}" > "$f.env"
""",
    # srun with --ntasks-per-node=1: run the command (once here)
    "srun": '#!/usr/bin/env bash\nexec "$@"\n',
    # scontrol show hostnames LIST
    "scontrol": "#!/usr/bin/env bash\necho node0\n",
}


def run_script(script: Path, workdir: Path, env: dict[str, str] | None = None) -> list[tuple[list[str], str]]:
    """Run an emitted script with stand-in launchers on PATH; every torchrun call's (argv, env value)."""
    bin_dir, capture = workdir / "bin", workdir / "capture"
    bin_dir.mkdir(parents=True, exist_ok=True)
    capture.mkdir(exist_ok=True)
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    nodes = next((ln.split("=", 1)[1] for ln in script.read_text().splitlines()
                  if ln.startswith("#SBATCH --nodes=")), "1")
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(workdir), "PLAN3D_CAPTURE": str(capture),
                # what sbatch sets for the job, and what a multi-node torchrun script asks for
                "SLURM_NNODES": nodes, "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "1",
                "MASTER_ADDR": "node0", "MEGATRON_LM": "/opt/Megatron-LM"} | (env or {})
    subprocess.run(["bash", str(script)], cwd=workdir, env=full_env, check=True, timeout=60,
                   capture_output=True)
    calls = []
    for argv_file in sorted(capture.glob("*.argv")):
        argv = argv_file.read_bytes().decode().split("\0")[:-1]
        calls.append((argv, argv_file.with_suffix(".env").read_text()))
        argv_file.unlink()
        argv_file.with_suffix(".env").unlink()
    return calls


# --- names ------------------------------------------------------------------------------------------
HOSTILE = ["$(touch PWNED)", "`touch PWNED`", "`id`", "a\nb", "x\ntouch PWNED", "../../x", "/abs/x",
           "Qwen/Qwen2.5-7B", "it's \"quoted\"", "; touch PWNED #", "-rf", "..", "${IFS}touch${IFS}PWNED"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_stay_in_out_dir_and_run_nothing(tmp_path, name):
    sc = scenario("llama3-8b", 16, 32, 4096, name=name, tp=8, pp=2, dp=1, sequence_parallel=True)
    sc = sc.model_copy(update={"hardware": sc.hardware.model_copy(update={"name": name})})  # a profile's name too
    out = tmp_path / "deep" / "out"
    written = write_all(out, render_all(sc, ["megatron", "torchrun", "slurm", "deepspeed", "plan"]))
    assert len(written) == 5
    for path in written:
        assert path.resolve().parent == out.resolve(), path
        assert slug(path.name) == path.name and path.name.startswith(slug(name) + "_"), path.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)  # nothing else, nothing hidden
    scripts = [p for p in written if p.suffix in (".sh", ".slurm")]
    for path in scripts:
        subprocess.run(["bash", "-n", str(path)], check=True)
        if any(c in name for c in "$`\n'\";/"):  # the name appears only as its slug
            assert name not in path.read_text()
    plan_file = next(p for p in written if p.name.endswith(".plan.json"))
    assert json.loads(plan_file.read_text())["model"]["name"] == name  # JSON keeps it, escaped
    run = tmp_path / "run"
    run.mkdir()
    for path in scripts:
        calls = run_script(path, run)
        assert len(calls) == 1 and calls[0][0][0].startswith("--")
        if path.suffix == ".slurm":  # validate mode: the plan file by its slug name
            (argv, _), = run_script(path, run, {"MODE": "validate"})
            assert argv[-5:] == ["planner.cli", "validate", plan_file.name, "--backend", "nccl"]
    assert not list(tmp_path.rglob("PWNED")) and not Path("PWNED").exists()
    assert not (tmp_path / "x").exists() and not (tmp_path / "deep" / "x").exists()
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it)")
    for path in scripts:
        res = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_write_all_refuses_names_outside_the_folder(tmp_path):
    for bad in ["../x.sh", "/abs/x.sh", "a/b.sh", ".hidden", "a\nb.sh", ""]:
        with pytest.raises(SpecError, match="not a plain file name"):
            write_all(tmp_path / "out", {bad: "echo\n"})
    assert not (tmp_path / "x.sh").exists()


def test_write_all_names_what_it_would_replace_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    write_all(out, {"a.sh": "echo a\n", "b.sh": "echo b\n"})
    with pytest.raises(SpecError, match=r"a.sh exists; pass --force"):
        write_all(out, {"a.sh": "new\n", "c.sh": "echo c\n"})
    with pytest.raises(SpecError, match=r"b.sh exist; pass --force"):
        write_all(out, {"a.sh": "new\n", "b.sh": "new\n"})
    assert (out / "a.sh").read_text() == "echo a\n" and not (out / "c.sh").exists()


def test_write_all_leaves_a_file_that_holds_the_same_text(tmp_path):
    """One format after another into one folder writes the plan file several formats carry: the same text again is
    no clash (nothing would be lost) and is not rewritten; another text still is refused without --force."""
    out = tmp_path / "out"
    write_all(out, {"p.plan.json": "{}\n", "a.slurm": "echo a\n"})
    before = (out / "p.plan.json").stat().st_mtime_ns
    unchanged = []
    written = write_all(out, {"p.plan.json": "{}\n", "b.json": "{}\n"}, unchanged=unchanged)
    assert written == [out / "p.plan.json", out / "b.json"] and unchanged == [out / "p.plan.json"]
    assert (out / "p.plan.json").stat().st_mtime_ns == before and (out / "b.json").read_text() == "{}\n"
    with pytest.raises(SpecError, match=r"p.plan.json exists; pass --force"):
        write_all(out, {"p.plan.json": "{\"other\": 1}\n", "c.json": "{}\n"})
    assert (out / "p.plan.json").read_text() == "{}\n" and not (out / "c.json").exists()


def test_emit_one_format_after_another_into_one_folder(tmp_path):
    """`plan3d emit --format slurm` then `--format deepspeed` into one folder: both carry the plan file, which the
    second finds holding what it would write (before, it refused: "plan.json exists; pass --force")."""
    from typer.testing import CliRunner

    from planner.cli import app
    from planner.io import write_atomic

    sc = scenario("llama3-8b", 16, 64, 4096, tp=1, pp=1, dp=16)
    plan = tmp_path / "p.json"
    write_atomic(plan, sc.model_dump_json())
    runner = CliRunner()
    first = runner.invoke(app, ["emit", str(plan), "--format", "slurm", "--out-dir", str(tmp_path / "out")])
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, ["emit", str(plan), "--format", "deepspeed", "--out-dir", str(tmp_path / "out")])
    assert second.exit_code == 0, second.output
    assert "unchanged (same content)" in second.output and "deepspeed.json" in second.output


def test_torchtitan_refusals_are_one_line_naming_the_slug():
    sc = scenario("gpt3-175b", 64, 64, 2048, name="evil\n$(touch PWNED)", tp=8, pp=8, dp=1)
    with pytest.raises(SpecError) as err:
        render_all(sc, ["torchtitan"])
    assert "\n" not in str(err.value) and "evil-touch-PWNED" in str(err.value)


# --- Megatron-LM core_v0.16.1 --------------------------------------------------------------------------
# Every plan kind plan3d writes: pp=1, even pp, stored even list (plan files), interleaved (vpp 2, 3),
# uneven first/last, uneven + interleaved, uneven middle (+ interleaved), SP, recompute, ZeRO 0-3,
# fp8, CP, GQA (llama) and MHA with learned positions and GeLU (GPT-3), SwiGLU (llama).
L70 = dict(model="llama3-70b", gpus=64, global_batch=128, seq_len=8192)
MEGATRON_PLANS = {
    "pp1-zero0": (dict(model="llama3-8b", gpus=16, global_batch=32, seq_len=4096), dict(tp=8, pp=1, dp=2)),
    "pp4-sp-selective-zero1": (L70, dict(tp=8, pp=4, dp=2, sequence_parallel=True, recompute="selective",
                                         zero_stage=1)),
    "pp4-stored-even-vpp2": (L70, dict(tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(20, 20, 20, 20),
                                       sequence_parallel=True, zero_stage=1)),
    "gpt3-vpp3-learned-gelu": (dict(model="gpt3-175b", gpus=64, global_batch=64, seq_len=2048),
                               dict(tp=8, pp=4, dp=2, vpp=3, sequence_parallel=True, recompute="selective",
                                    zero_stage=1)),
    "uneven-first-last": (L70, dict(tp=8, pp=4, dp=2, layers_per_stage=(19, 21, 21, 19), zero_stage=1)),
    "uneven-vpp2": (L70, dict(tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(18, 22, 22, 18), zero_stage=1)),
    "uneven-middle": (L70, dict(tp=8, pp=4, dp=2, layers_per_stage=(20, 15, 25, 20))),
    "uneven-middle-vpp2": (L70, dict(tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(20, 16, 24, 20))),
    "full-recompute-zero0": (L70, dict(tp=8, pp=4, dp=2, recompute="full")),
    # Megatron's block method: the first 3 of each chunk's 10 layers recomputed (Plan.recompute_num_layers)
    "block-recompute-vpp2": (L70, dict(tp=8, pp=4, dp=2, vpp=2, recompute="full", recompute_num_layers=3,
                                       sequence_parallel=True, zero_stage=1)),
    # Megatron's uniform method in groups of 4 layers (Plan.recompute_group_layers)
    "uniform-groups-of-4": (L70, dict(tp=8, pp=4, dp=2, recompute="full", recompute_group_layers=4,
                                      sequence_parallel=True, zero_stage=1)),
    # --distribute-saved-activations: full recompute, tp > 1, no SP (TrainingSpec.distribute_saved_activations)
    "distributed-checkpoints": (L70 | {"distribute_saved_activations": True},
                                dict(tp=8, pp=4, dp=2, recompute="full", zero_stage=1)),
    "zero2-fsdp": (dict(model="llama3-8b", gpus=16, global_batch=32, seq_len=4096),
                   dict(tp=2, pp=1, dp=8, zero_stage=2, sequence_parallel=True)),
    "zero3-fsdp-pp2": (L70, dict(tp=8, pp=2, dp=4, zero_stage=3, layers_per_stage=(40, 40))),
    "fp8": (L70 | {"precision": "fp8"}, dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    # Megatron-Bridge's bf16_with_fp8_subchannel_scaling_mixed: --fp8-format hybrid --fp8-recipe blockwise
    "fp8-blockwise": (L70 | {"precision": "fp8", "fp8_recipe": "blockwise"},
                      dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    "mxfp8-gb200": (L70 | {"precision": "mxfp8", "hardware": "gb200-nvl72"},
                    dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    # --fp8-param-gather (Megatron-Bridge's fp8 and mxfp8 recipes set fp8_param_gather; mxfp8 also
    # reuse_grad_buf_for_mxfp8_param_ag, which MixedPrecisionConfig.finalize requires with it)
    "fp8-params": (L70 | {"precision": "fp8", "fp8_params": True},
                   dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    "mxfp8-params-gb200": (L70 | {"precision": "mxfp8", "hardware": "gb200-nvl72", "fp8_params": True},
                           dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    # Megatron-Bridge's Llama recipes: cross_entropy_loss_fusion (GPTModelProvider default) with the TE kernel
    "te-cross-entropy": (L70 | {"cross_entropy_fusion": "te"}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    "native-cross-entropy": (L70 | {"cross_entropy_fusion": "native"}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    # Megatron's precision-aware optimizer with bf16 moments (Megatron-Bridge's DeepSeek-V3 recipe sets it)
    "bf16-adam-states": (L70 | {"optimizer_dtype": "bf16"}, dict(tp=8, pp=4, dp=2, sequence_parallel=True,
                                                                 zero_stage=1)),
    "nvfp4-b300": (L70 | {"precision": "nvfp4", "hardware": "b300-288gb"},
                   dict(tp=8, pp=4, dp=2, sequence_parallel=True, zero_stage=1)),
    "cp2": (L70, dict(tp=8, pp=2, cp=2, dp=2, sequence_parallel=True, zero_stage=1)),
    # --num-distributed-optimizer-instances 2: two copies of the distributed optimizer over dp x cp = 4 ranks
    "partial-distributed-optimizer": (L70 | {"dist_optimizer_instances": 2},
                                      dict(tp=8, pp=2, cp=2, dp=2, sequence_parallel=True, zero_stage=1)),
    # the gradient dtype: --grad-reduce-in-bf16 under --bf16; under --fp16 Megatron keeps fp16 gradients unless
    # --accumulate-allreduce-grads-in-fp32 (core_v0.16.1 arguments.py validate_args)
    "bf16-grads": (L70 | {"grad_reduce_in_bf16": True}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    "fp16-fp32-grads": (L70 | {"fp16": True}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    "fp16-16bit-grads": (L70 | {"fp16": True, "grad_reduce_in_bf16": True}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    "8b-pp2-uneven-vpp2": (dict(model="llama3-8b", gpus=16, global_batch=32, seq_len=4096),
                           dict(tp=4, pp=2, dp=2, vpp=2, layers_per_stage=(14, 18), zero_stage=1)),
    # the README's estimate example (gpt3-175b on 64 A100s, tp8 pp8 vpp3, SP, selective)
    "readme-gpt3-a100-vpp3": (dict(model="gpt3-175b", gpus=64, global_batch=64, seq_len=2048, hardware="a100-80gb"),
                              dict(tp=8, pp=8, dp=1, vpp=3, sequence_parallel=True, recompute="selective")),
    "405b-uneven-pp16": (dict(model="llama3-405b", gpus=256, global_batch=256, seq_len=8192),
                         dict(tp=8, pp=16, dp=2, layers_per_stage=(7,) + (8,) * 14 + (7,),
                              sequence_parallel=True, zero_stage=1)),
    # Meta's Llama 3 405B layout (Dubey et al. 2024, 3.3.2): interleaved, first and last stage one layer
    # short, so stages of 7 do not split into vpp chunks evenly; with Meta's tunable N (group size)
    "405b-meta-vpp4": (dict(model="llama3-405b", gpus=256, global_batch=256, seq_len=8192),
                       dict(tp=8, pp=16, dp=2, vpp=4, layers_per_stage=(7,) + (8,) * 14 + (7,),
                            sequence_parallel=True, zero_stage=1)),
    "405b-meta-vpp2-group": (dict(model="llama3-405b", gpus=256, global_batch=320, seq_len=8192),
                             dict(tp=8, pp=16, dp=2, vpp=2, layers_per_stage=(7,) + (8,) * 14 + (7,),
                                  microbatch_group_size=20, sequence_parallel=True, zero_stage=1)),
    # NVIDIA's Llama 3.1 405B (PP16 x VP8, --account-for-embedding/loss-in-pipeline-split): 126 layers + E + L
    # = 128 slots, one per virtual stage, so rank 0's chunk 0 holds only E and rank 15's chunk 7 only L
    "405b-vpp8-embedding-loss-chunks": (dict(model="llama3-405b", gpus=1024, global_batch=1536, seq_len=8192,
                                             precision="fp8"),
                                        dict(tp=4, pp=16, dp=16, vpp=8, layers_per_stage=(7,) + (8,) * 14 + (7,),
                                             sequence_parallel=True, recompute="full", zero_stage=1)),
    "tp-overlap-no-p2p-overlap": (L70 | {"tp_comm_overlap": True, "overlap_p2p_comm": False},
                                  dict(tp=8, pp=4, dp=2, vpp=2, sequence_parallel=True, zero_stage=1)),
    "group-size-m-not-multiple-of-pp": (L70 | {"global_batch": 20}, dict(tp=8, pp=4, dp=2, vpp=2,
                                                                          microbatch_group_size=10, zero_stage=1)),
    # Megatron-Bridge's Llama 3 70B on GB200 (Megatron-FSDP, activations offloaded: cpu_offloading_num_layers)
    "cpu-offload-fsdp-gb200": (L70 | {"global_batch": 256, "precision": "fp8", "hardware": "gb200-nvl72"},
                               dict(tp=1, pp=1, dp=64, micro_batch_size=2, zero_stage=3, cpu_offload_layers=40)),
}


@pytest.fixture(scope="session")
def megatron(megatron_lm_root):
    """Megatron-LM core_v0.16.1's argument, micro-batch and config modules (conftest.megatron_lm_root)."""
    try:
        import megatron.training.arguments as arguments
        from megatron.core import num_microbatches_calculator as mbc
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
    except ImportError as err:
        pytest.skip(f"Megatron-LM core_v0.16.1 does not import here ({err}); "
                    "pip install -r requirements-consumers.txt")
    return {"arguments": arguments, "mbc": mbc, "rope_utils": rope_utils, "LayerType": LayerType,
            "get_num_layers_to_build": get_num_layers_to_build}


def torchrun_world(argv: list[str]) -> tuple[int, str, list[str]]:
    """(WORLD_SIZE torchrun would set, training script, its arguments), read with torchrun's own parser."""
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    args = get_args_parser().parse_args(argv)
    low, high = parse_min_max_nnodes(args.nnodes)
    assert low == high, args.nnodes
    return low * int(args.nproc_per_node), args.training_script, args.training_script_args


# compute capability major of the profiles' GPUs (NVIDIA CUDA GPUs list: A100 8.0, H100 9.0)
ARCH = {"a100": 8, "h100": 9, "h200": 9, "b200": 10, "b300": 10, "gb200": 10, "gb300": 10}


def megatron_validate(mg, monkeypatch, argv: list[str], env_value: str, arch: int = 9):
    """Megatron's own startup on the captured torchrun argv, rank 0; returns (args, config, microbatches)."""
    world, script, script_args = torchrun_world(argv)
    assert script.endswith("/pretrain_gpt.py")
    arguments = mg["arguments"]
    # Shimmed, and nothing else: (1) get_device_arch_version() asks torch.cuda for device 0's compute
    # capability; there is no GPU here. Answer the plan's GPU (9 for H100, 8 for A100): below 10 is
    # the branch where validate_args checks CUDA_DEVICE_MAX_CONNECTIONS. (2) TransformerConfig
    # refuses the default --rope-fusion unless Transformer Engine's fused RoPE kernel imported
    # (rope_utils.fused_apply_rotary_pos_emb is None without TE); stand in a placeholder for that kernel,
    # as any GPU image with TE >= 1.4 has it.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: arch)
    monkeypatch.setattr(mg["rope_utils"], "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    if "--fp4-format" in script_args:
        # (3) NVFP4: validate_args asks is_te_min_version("2.7.0.dev0"), Transformer Engine's installed
        # version (TE needs CUDA; absent here). Answer as an image with TE 2.7+ would, for NVFP4 plans only.
        monkeypatch.setattr(arguments, "is_te_min_version", lambda version, *a, **k: True)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    if env_value == "<unset>":
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", env_value)
    monkeypatch.setattr(sys, "argv", [script] + script_args)
    args = arguments.parse_args()
    arguments.validate_args(args, dict(PRETRAIN_GPT_DEFAULTS))
    config = arguments.core_transformer_config_from_args(args)
    mbc = mg["mbc"]
    mbc.destroy_num_microbatches_calculator()
    # as megatron/training/global_vars.py::_build_num_microbatches_calculator calls it
    mbc.init_num_microbatches_calculator(args.rank, args.rampup_batch_size, args.global_batch_size,
                                         args.micro_batch_size, args.data_parallel_size,
                                         args.decrease_batch_size_if_needed)
    try:
        microbatches = mbc.get_num_microbatches()
    finally:
        mbc.destroy_num_microbatches_calculator()
    return args, config, microbatches


def megatron_layers(mg, config) -> list[list[int]]:
    """Transformer layers Megatron builds on each [pipeline rank][virtual stage]."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    if config.pipeline_model_parallel_layout is not None:
        layout = config.pipeline_model_parallel_layout.layout
        return [[layout[r][v].count(mg["LayerType"].decoder) for v in range(vpp)] for r in range(pp)]
    return [[mg["get_num_layers_to_build"](config, vp_stage=v if vpp > 1 else None, pp_rank=r)
             for v in range(vpp)] for r in range(pp)]


@pytest.mark.parametrize("case", MEGATRON_PLANS)
def test_megatron_lm_accepts_emitted_torchrun_and_slurm(megatron, monkeypatch, tmp_path, case):
    job, plan = MEGATRON_PLANS[case]
    check_with_megatron(megatron, monkeypatch, tmp_path, scenario(**job, **plan))


def test_megatron_lm_accepts_the_readme_search(megatron, monkeypatch, tmp_path):
    """The README's `plan3d search` (llama3-70b, 64 H100s, batch 128, 8k): whatever plan it picks."""
    from planner.candidates import SearchSpace
    from planner.search import search

    model, hw = load_model("llama3-70b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192)
    best = search(model, hw, tr, SearchSpace()).best
    check_with_megatron(megatron, monkeypatch, tmp_path, Scenario(model=model, hardware=hw, training=tr, plan=best))


def test_megatron_accepts_a_deferred_embedding_wgrad_launch(megatron, monkeypatch, tmp_path):
    """A job that defers the output layer's wgrad (TrainingSpec.defer_embedding_wgrad, NeMo's large-model recipes):
    Megatron's own startup takes the two flags plan3d writes, with the limit."""
    model, hw = load_model("llama3-70b"), load_hardware("h100-sxm-80gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, defer_embedding_wgrad=True,
                      wgrad_deferral_limit=22)
    plan = Plan(tp=8, pp=4, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    check_with_megatron(megatron, monkeypatch, tmp_path, Scenario(model=model, hardware=hw, training=tr, plan=plan))


def test_megatron_accepts_bf16_end_layers(megatron, monkeypatch, tmp_path):
    """MXFP8 on B200 with the first two and the last layer in bf16 (TrainingSpec.bf16_layers_at_start/end): Megatron's
    own startup takes the three flags plan3d writes (TransformerConfig checks each count against num_layers // pp)."""
    model, hw = load_model("llama3-70b"), load_hardware("b200-180gb")
    tr = TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192, precision="mxfp8", bf16_layers_at_start=2,
                      bf16_layers_at_end=1)
    plan = Plan(tp=8, pp=4, dp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    check_with_megatron(megatron, monkeypatch, tmp_path, Scenario(model=model, hardware=hw, training=tr, plan=plan))


def check_with_megatron(megatron, monkeypatch, tmp_path, sc: Scenario) -> None:
    p, m = sc.resolved_plan(), sc.model
    case = sc.plan.label()
    arch = next(v for k, v in ARCH.items() if sc.hardware.name.startswith(k))
    written = write_all(tmp_path / "out", render_all(sc, ["megatron", "torchrun", "slurm"]))
    scripts = [w for w in written if w.suffix in (".sh", ".slurm")]
    assert len(scripts) == 2
    (args_file,) = [w for w in written if w.name.endswith(".megatron.args")]
    # the argument file, passed on as docs/emit.md says: $(grep -v '^#' FILE), i.e. split on whitespace
    file_words = " ".join(ln for ln in args_file.read_text().splitlines() if not ln.startswith("#")).split()
    fsdp = p.zero_stage >= 2
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        if shutil.which("shellcheck"):  # test_hostile_names_... says when it is missing
            res = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
            assert res.returncode == 0, res.stdout
        # a user's shell may already export CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's TP advice)
        (argv, env_value), = run_script(script, tmp_path / "run", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert env_value == ("<unset>" if fsdp else "1"), script.name
        assert torchrun_world(argv)[2] == file_words, "the .megatron.args file passes what the scripts pass"
        args, config, microbatches = megatron_validate(megatron, monkeypatch, argv, env_value, arch)
        assert args.world_size == sc.training.num_gpus and args.data_parallel_size == p.dp
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == \
            (p.tp, p.pp, p.cp)
        assert microbatches == p.num_microbatches
        assert (config.virtual_pipeline_model_parallel_size or 1) == p.vpp
        layers = megatron_layers(megatron, config)
        assert layers == [list(c) for c in chunk_split(p.layers_per_stage, p.vpp)], (case, layers)
        if p.vpp > 1:
            assert config.microbatch_group_size_per_vp_stage == (p.microbatch_group_size or p.pp)
        assert config.sequence_parallel == p.sequence_parallel
        from planner.cost import resolved_overlap

        overlap = resolved_overlap(sc.training)
        assert bool(config.tp_comm_overlap) == (overlap.tp_comm_overlap and p.sequence_parallel and p.tp > 1)
        assert bool(args.overlap_p2p_comm) == (overlap.overlap_p2p_comm and p.vpp > 1)
        assert config.recompute_granularity == (None if p.recompute == "none" else p.recompute)
        if p.recompute == "full":  # the layers recomputed per chunk (transformer_block.py _checkpointed_forward)
            assert (config.recompute_method, config.recompute_num_layers) == \
                (("block", p.recompute_num_layers) if p.recompute_num_layers is not None
                 else ("uniform", p.recompute_group_layers or 1))
        assert bool(config.distribute_saved_activations) == sc.training.distribute_saved_activations
        # --cpu-offloading-num-layers turns cpu_offloading on in validate_args; TransformerConfig checks pp 1,
        # no recompute, fewer than num_layers (transformer_config.py __post_init__)
        assert (config.cpu_offloading, config.cpu_offloading_num_layers) == (p.cpu_offload_layers > 0,
                                                                            p.cpu_offload_layers)
        assert (config.cpu_offloading_activations, config.cpu_offloading_weights) == (True, False)
        assert bool(args.use_distributed_optimizer) == (p.zero_stage == 1)
        assert args.num_distributed_optimizer_instances == sc.training.dist_optimizer_instances
        assert bool(args.use_megatron_fsdp) == fsdp
        if fsdp:
            assert args.data_parallel_sharding_strategy == {2: "optim_grads", 3: "optim_grads_params"}[p.zero_stage]
        fp8_format = {"fp8": "hybrid", "mxfp8": "e4m3"}.get(sc.training.precision)
        assert config.fp8 == fp8_format
        if fp8_format:
            # delayed: core_v0.16.1's default
            assert config.fp8_recipe == ("mxfp8" if sc.training.precision == "mxfp8" else sc.training.fp8_recipe)
        assert bool(config.cross_entropy_loss_fusion) == (sc.training.cross_entropy_fusion != "none")
        if config.cross_entropy_loss_fusion:
            assert config.cross_entropy_fusion_impl == sc.training.cross_entropy_fusion
        assert bool(args.fp8_param_gather) == sc.training.fp8_params
        import torch

        # the 16-bit format and the gradient dtype the memory and DP terms assumed (TrainingSpec.grad_reduce_in_bf16)
        assert args.params_dtype == (torch.half if sc.training.fp16 else torch.bfloat16)
        assert bool(args.accumulate_allreduce_grads_in_fp32) == (not sc.training.grad_reduce_in_bf16)

        bf16_adam = sc.training.optimizer_dtype == "bf16"
        assert bool(args.use_precision_aware_optimizer) == bf16_adam
        assert (args.exp_avg_dtype, args.exp_avg_sq_dtype) == ((torch.bfloat16,) * 2 if bf16_adam else (torch.float32,) * 2)
        assert bool(args.reuse_grad_buf_for_mxfp8_param_ag) == (sc.training.fp8_params
                                                                and sc.training.precision == "mxfp8")
        # the dataloader mask and the deferred output-layer wgrad the memory assumed (docs/memory.md "Other")
        assert args.create_attention_mask_in_dataloader == sc.training.attention_mask_in_dataloader
        assert (config.defer_embedding_wgrad_compute, config.wgrad_deferral_limit) == \
            (sc.training.defer_embedding_wgrad, sc.training.wgrad_deferral_limit)
        bf16_ends = (sc.training.bf16_layers_at_start, sc.training.bf16_layers_at_end)
        assert config.first_last_layers_bf16 == any(bf16_ends)
        if any(bf16_ends):
            assert (config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16) == bf16_ends
        assert config.fp4 == ("e2m1" if sc.training.precision == "nvfp4" else None)
        if config.fp4:
            assert config.fp4_recipe == "nvfp4"
        assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == \
            (m.num_layers, m.hidden_size, m.ffn_size)
        assert (config.num_query_groups or config.num_attention_heads) == m.kv_heads
        assert config.gated_linear_unit == (m.activation == "swiglu")
        assert args.position_embedding_type == {"rope": "rope", "learned": "learned_absolute"}[m.position_embedding]
        assert args.rotary_percent == m.rotary_percent  # GLM-4.5's RoPE on half of each head (ModelSpec.rotary_percent)
        assert config.add_bias_linear == m.linear_bias


def test_megatron_account_for_flags_build_the_layout_plan3d_writes(megatron, monkeypatch, tmp_path):
    """Megatron's own rule for the embedding and loss slots is the oracle for the chunks plan3d writes
    as a layout: the same argv with --account-for-embedding/loss-in-pipeline-split instead of the layout
    builds, per (rank, virtual stage), what the layout builds: [0, 1 x 7] on rank 0, [1 x 7, 0] on rank 15."""
    job, plan = MEGATRON_PLANS["405b-vpp8-embedding-loss-chunks"]
    sc = scenario(**job, **plan)
    (script,) = [w for w in write_all(tmp_path / "o", render_all(sc, ["torchrun"])) if w.suffix == ".sh"]
    (argv, env_value), = run_script(script, tmp_path / "run")
    i = argv.index("--pipeline-model-parallel-layout")
    layout = argv[i + 1]
    assert layout.startswith("E|t|") and layout.endswith("|t|L") and layout.count("|") == 127
    _, config, _ = megatron_validate(megatron, monkeypatch, argv, env_value)
    from_layout = megatron_layers(megatron, config)
    flags = argv[:i] + ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                        "--num-virtual-stages-per-pipeline-rank", "8"] + argv[i + 2:]
    _, config, _ = megatron_validate(megatron, monkeypatch, flags, env_value)
    assert config.pipeline_model_parallel_layout is None
    from_flags = megatron_layers(megatron, config)
    assert from_flags == from_layout
    assert from_flags[0] == [0] + [1] * 7 and from_flags[15] == [1] * 7 + [0]
    assert all(row == [1] * 8 for row in from_flags[1:15])
    # `plan3d check` reads the account-for flags as Megatron builds them (NVIDIA's own launch files use them)
    import shlex

    from planner.check import check_file_branches

    launch = tmp_path / "account_for.sh"  # the captured torchrun argv, replayed as a launch script
    launch.write_text("#!/bin/bash\ntorchrun " + " ".join(shlex.quote(w) for w in flags) + "\n")
    (read,) = check_file_branches(launch, load_hardware("h100-sxm-80gb"), None, None)
    assert not read.errors, read.errors
    assert [list(c) for c in read.scenario.resolved_plan().chunk_layers(126)] == from_flags
    # a middle chunk left empty is no layout Megatron's account_for rules build: 2 slots over 16 x 8 stages
    bad = flags[:]
    bad[bad.index("--num-layers") + 1] = "125"
    with pytest.raises(ValueError, match="must be divisible"):
        megatron_validate(megatron, monkeypatch, bad, env_value)


def test_megatron_refusals_are_megatrons_own(megatron, monkeypatch, tmp_path):
    """The checks above can fail: Megatron rejects what plan3d used to write (issue 14)."""
    sc = scenario(**L70, tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(18, 22, 22, 18), zero_stage=3)
    (script,) = [w for w in write_all(tmp_path / "o", render_all(sc, ["torchrun"])) if w.suffix == ".sh"]
    (argv, _), = run_script(script, tmp_path / "run")
    i = argv.index("--num-virtual-stages-per-pipeline-rank")
    old_style = argv[:i] + ["--num-layers-per-virtual-pipeline-stage", "10"] + argv[i + 2:]
    with pytest.raises(AssertionError, match="please use --num-virtual-stages-per-pipeline-rank"):
        megatron_validate(megatron, monkeypatch, old_style, "<unset>")
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        megatron_validate(megatron, monkeypatch, argv, "1")
    j = argv.index("--ckpt-format")
    with pytest.raises(AssertionError, match="fsdp_dtensor"):
        megatron_validate(megatron, monkeypatch, argv[:j] + argv[j + 2:], "<unset>")


def test_megatron_refuses_what_plan3d_refuses_for_distributed_checkpoints(megatron, monkeypatch, tmp_path):
    """--distribute-saved-activations: plan3d's rules (specs.distributed_checkpoint_problems) are Megatron's own,
    met by the emitted launch and broken by each of the edits below."""
    sc = scenario(**L70, distribute_saved_activations=True, tp=8, pp=4, dp=2, recompute="full", zero_stage=1)
    (script,) = [w for w in write_all(tmp_path / "o", render_all(sc, ["torchrun"])) if w.suffix == ".sh"]
    (argv, _), = run_script(script, tmp_path / "run")
    assert "--distribute-saved-activations" in argv
    megatron_validate(megatron, monkeypatch, argv, "1")
    i = argv.index("--recompute-granularity")
    assert argv[i + 1:i + 6] == ["full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    selective = argv[:i] + ["--recompute-granularity", "selective"] + argv[i + 6:]
    with pytest.raises(AssertionError, match="only application to full recompute"):
        megatron_validate(megatron, monkeypatch, selective, "1")
    with pytest.raises(ValueError, match="must be false when sequence parallel"):
        megatron_validate(megatron, monkeypatch, argv + ["--sequence-parallel"], "1")
    for change, reason in ((dict(recompute="selective"), "applies to full recompute only"),
                           (dict(sequence_parallel=True), "refuses it with sequence parallelism")):
        bad = sc.model_copy(update={"plan": sc.plan.model_copy(update=change)})
        assert any(reason in line for line in plan_problems(bad.model, bad.hardware, bad.training, bad.plan))


# --- torchtitan 0.3.0 --------------------------------------------------------------------------------
L8 = dict(model="llama3-8b", gpus=16, global_batch=32, seq_len=4096)
Q30 = dict(model="qwen3-30b-a3b", gpus=16, global_batch=32, seq_len=4096)  # 4 KV heads: tp at most 4 here
TORCHTITAN_PLANS = {
    "qwen3-moe-tp4-ep4": (Q30, dict(tp=4, pp=1, dp=4, micro_batch_size=1, zero_stage=3, ep=4, etp=1,
                                    sequence_parallel=True)),
    "pp1-zero0": (L8, dict(tp=8, pp=1, dp=2, micro_batch_size=1)),
    "pp1-zero3-mbs2": (L8, dict(tp=2, pp=1, dp=8, micro_batch_size=2, zero_stage=3)),
    # llama3_8b_mxfp8 (torchao MXFP8 linears on Blackwell)
    "8b-mxfp8-b200": (L8 | {"precision": "mxfp8", "hardware": "b200-180gb"},
                      dict(tp=1, pp=1, dp=16, micro_batch_size=1, zero_stage=3)),
    "pp4-stored-even-vpp2": (L70, dict(tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(20, 20, 20, 20),
                                       sequence_parallel=True, zero_stage=1)),
    "uneven-first-last": (L70, dict(tp=8, pp=4, dp=2, layers_per_stage=(19, 21, 21, 19), recompute="full")),
    "cp2": (L70, dict(tp=8, pp=2, cp=2, dp=2, sequence_parallel=True, zero_stage=1)),
    # the gradient dtype: --grad-reduce-in-bf16 under --bf16; under --fp16 Megatron keeps fp16 gradients unless
    # --accumulate-allreduce-grads-in-fp32 (core_v0.16.1 arguments.py validate_args)
    "bf16-grads": (L70 | {"grad_reduce_in_bf16": True}, dict(tp=8, pp=4, dp=2, zero_stage=1)),
    # (no fp16 case: torchtitan 0.3.0 has no fp16 parameter dtype, and the emitter refuses such a plan,
    # test_torchtitan_refuses_fp16)
    # torchtitan's own first/last_stage_less_layers 1: 32 layers + E + L = 34 stages of one slot, stage 0
    # only the embedding, stage 33 only norm + output (llama3_405b needs torchao's float8 to load here)
    "8b-vpp17-embedding-loss-chunks": (L8, dict(tp=8, pp=2, dp=1, vpp=17, layers_per_stage=(16, 16))),
    # torchtitan's default keys (first/last 1) on Llama-3-70B: 20/21/20/19, the middle stages unequal (the profile's
    # split_rule, planner.frameworks.torchtitan.builds_split), at vpp 1 and 2
    "70b-pp4-default-split": (L70, dict(tp=8, pp=4, dp=2, layers_per_stage=(20, 21, 20, 19))),
    "70b-pp4-vpp2-default-split": (L70, dict(tp=8, pp=4, dp=2, vpp=2, layers_per_stage=(20, 21, 20, 19))),
    # 4/5/4/4/4/4/4/3 on 8 virtual stages: no layers_per_stage gives 8 stages (5 makes 7), the default count does
    "8b-pp4-vpp2-default-count": (L8, dict(tp=4, pp=4, dp=1, vpp=2, layers_per_stage=(8, 9, 8, 7))),
}


@pytest.fixture(scope="session")
def torchtitan():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (requirements-consumers.txt)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import pipeline_parallel as pipe

    return ConfigManager, ParallelDims, pipe


def _torchtitan_argv(script: Path, workdir: Path) -> tuple[int, list[str]]:
    (argv, _), = run_script(script, workdir)
    world, module, rest = torchrun_world(argv)  # "-m torchtitan.train": torchrun's parser keeps -m apart
    return world, rest


@pytest.mark.parametrize("case", TORCHTITAN_PLANS)
def test_torchtitan_accepts_emitted_launch(torchtitan, tmp_path, monkeypatch, case):
    ConfigManager, ParallelDims, pipe = torchtitan
    job, plan = TORCHTITAN_PLANS[case]
    sc = scenario(**job, **plan)
    if sc.training.precision == "mxfp8":
        # stand-in for exactly one CUDA query: MXFP8LinearConverter.__init__ (components/quantization/mx.py) asks
        # has_cuda_capability(10, 0); there is no GPU here, so answer as the plan's Blackwell GPU would
        from torchtitan.components.quantization import mx

        monkeypatch.setattr(mx, "has_cuda_capability", lambda major, minor: True)
    p = sc.resolved_plan()
    (script,) = write_all(tmp_path / "o", render_all(sc, ["torchtitan"]))
    world, argv = _torchtitan_argv(script, tmp_path / "run")
    assert world == sc.training.num_gpus
    cfg = ConfigManager().parse_args(argv)  # tyro parse + Trainer.Config.__post_init__
    # Trainer.__init__'s model-config check (torchtitan/trainer.py: model_spec.model.update_from_config): tp divides
    # the heads and the KV heads, no weight tying under PP, seq_len within the model's RoPE length
    cfg.model_spec.model.update_from_config(config=cfg)
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world)  # checks the degrees multiply to WORLD_SIZE
    # Trainer.__init__ (torchtitan/trainer.py), the checks that need no device: sequence divisibility,
    # batch = local x (dp_replicate x dp_shard, its "batch" mesh), accumulation steps, PP micro-batches.
    divisor = (dims.tp if par.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
    assert cfg.training.seq_len % divisor == 0
    batch_degree = dims.dp_replicate * dims.dp_shard
    assert cfg.training.global_batch_size % (cfg.training.local_batch_size * batch_degree) == 0
    accumulation = cfg.training.global_batch_size // (cfg.training.local_batch_size * batch_degree)
    pp_microbatches = cfg.training.local_batch_size // par.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    forward_batch = par.pipeline_parallel_microbatch_size if dims.pp > 1 else cfg.training.local_batch_size
    assert forward_batch == p.micro_batch_size, "sequences per forward pass"
    assert accumulation * pp_microbatches == p.num_microbatches
    assert batch_degree == p.dp and dims.tp == p.tp and dims.cp == p.cp and dims.pp == p.pp
    if dims.pp > 1:  # pipeline_llm's own split: layers on every virtual stage, stages on ranks
        num_stages, num_layers, first_less, last_less = pipe._get_pipeline_metadata(dims, par, cfg.model_spec.model)
        assert num_stages == p.pp * p.vpp and num_layers == sc.model.num_layers
        parts = pipe._generate_llm_fqn_per_model_part(num_stages, num_layers, first_less, last_less)
        per_stage = [sum(name.startswith("layers.") for name in part) for part in parts]
        per_rank = [sum(per_stage[s] for s in range(r, num_stages, p.pp)) for r in range(p.pp)]  # loop style
        assert per_rank == list(p.layers_per_stage), per_stage
        chunks = chunk_split(p.layers_per_stage, p.vpp)
        assert per_stage == [chunks[s % p.pp][s // p.pp] for s in range(num_stages)]


def test_torchtitan_refuses_fp16(torchtitan):
    """torchtitan 0.3.0's ``training.mixed_precision_param`` is ``Literal["bfloat16", "float32"]``: an fp16 plan
    cannot be launched there, and the emitter says so instead of writing a bf16 run (it used to)."""
    import typing

    from torchtitan.config.configs import TrainingConfig

    allowed = typing.get_args(typing.get_type_hints(TrainingConfig)["mixed_precision_param"])
    assert "float16" not in allowed and "bfloat16" in allowed
    job, plan = L70 | {"fp16": True}, dict(tp=8, pp=4, dp=2, zero_stage=1)
    with pytest.raises(SpecError, match="torchtitan 0.3.0 trains in bfloat16 or float32"):
        render_all(scenario(**job, **plan), ["torchtitan"])


def test_torchtitan_split_mirror_matches_torchtitan(torchtitan):
    from planner.frameworks.torchtitan import split_layers

    _, _, pipe = torchtitan
    for stages, layers, first, last in [(8, 80, 0, 0), (4, 80, 2, 2), (16, 126, 1, 1), (6, 32, 1, 0), (3, 5, 2, 2)]:
        try:
            theirs = [sum(n.startswith("layers.") for n in part)
                      for part in pipe._generate_llm_fqn_per_model_part(stages, layers, first, last)]
        except ValueError:
            theirs = None
        assert split_layers(stages, layers, first, last) == theirs


def test_torchtitan_refuses_what_it_cannot_run():
    with pytest.raises(SpecError, match="cannot place"):  # uneven middle: torchtitan shortens only the ends
        render_all(scenario(**L70, tp=8, pp=4, dp=2, layers_per_stage=(20, 15, 25, 20)), ["torchtitan"])
    with pytest.raises(SpecError, match="trains in bf16"):  # llama3_70b has no float8 converter
        render_all(scenario(**L70, precision="fp8", tp=8, pp=4, dp=2), ["torchtitan"])
    with pytest.raises(SpecError, match="trains in fp8"):  # llama3_405b always converts to float8
        render_all(scenario("llama3-405b", 256, 256, 8192, tp=8, pp=16, dp=2,
                            layers_per_stage=(7,) + (8,) * 14 + (7,)), ["torchtitan"])


# --- DeepSpeed ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [dict(tp=8, pp=4, dp=2, zero_stage=0), dict(tp=8, pp=4, dp=2, zero_stage=1),
                                  dict(tp=8, pp=1, dp=8, zero_stage=2), dict(tp=8, pp=1, dp=8, zero_stage=3)])
def test_deepspeed_config_and_pipeline_constraint(monkeypatch, tmp_path, plan):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (the Makefile installs it)")
    import inspect

    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.pipe.engine import PipelineEngine

    sc = scenario(**L70, **plan)
    (config,) = [w for w in write_all(tmp_path, render_all(sc, ["deepspeed"])) if w.name.endswith(".deepspeed.json")]

    class Mpu:  # what Megatron's mpu tells DeepSpeed: the data-parallel group
        def get_data_parallel_world_size(self):
            return sc.plan.dp

        def get_data_parallel_rank(self):
            return 0

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)  # rank 0 of a launched job, no backend
    cfg = ds_config.DeepSpeedConfig(str(config), mpu=Mpu())
    p = sc.resolved_plan()
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * p.dp
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (p.micro_batch_size,
                                                                                     p.num_microbatches)
    assert cfg.zero_optimization_stage == p.zero_stage
    # the bucket settings plan3d counted (planner/frameworks/deepspeed.py), as DeepSpeed reads them
    zero, ds = cfg.zero_config, sc.training.deepspeed
    assert (zero.reduce_bucket_size, zero.contiguous_gradients, zero.overlap_comm) == \
        (ds.reduce_bucket_elements, ds.contiguous_gradients, sc.training.overlap_grad_reduce)
    assert p.zero_stage < 3 or zero.prefetch_bucket_size == ds.prefetch_bucket_elements
    # PipelineEngine.__init__ asserts ZeRO < 2: plan3d refuses ZeRO-2/3 with pp > 1 for the same reason
    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in inspect.getsource(PipelineEngine.__init__)
    if p.zero_stage >= 2:
        with pytest.raises(SpecError, match="ZeRO 0 or 1"):
            render_all(sc.model_copy(update={"plan": Plan(tp=8, pp=4, dp=2, micro_batch_size=1,
                                                          zero_stage=p.zero_stage)}), ["deepspeed"])


def test_emit_cli_with_a_hugging_face_style_name(runner, tmp_path):
    """issue 17: a '/' in the name made `emit` fail; '$(...)' and newlines must stay inert."""
    from planner.cli import app
    from planner.render import scenario_json

    for name in ["Qwen/Qwen2.5-7B", "x\n$(touch PWNED)"]:
        plan = tmp_path / "plan.json"
        plan.write_text(scenario_json(scenario("llama3-8b", 16, 32, 4096, name=name, tp=8, pp=2, dp=1)))
        out = tmp_path / slug(name)
        res = runner.invoke(app, ["emit", str(plan), "--format", "megatron,torchrun,slurm", "--out-dir", str(out)])
        assert res.exit_code == 0, res.output
        assert sorted(p.name for p in out.iterdir()) == sorted(
            f"{slug(name)}_tp8-pp2-dp1_mbs1{ext}" for ext in (".megatron.args", ".plan.json", ".slurm", ".torchrun.sh"))
    assert not list(tmp_path.rglob("PWNED"))


def test_megatron_refuses_offloading_where_plan3d_does(megatron, monkeypatch, tmp_path):
    """Megatron's own TransformerConfig is the oracle for plan3d's cpu_offload_layers rules (specs.Plan,
    specs.plan_problems): it refuses offloading with pipeline parallelism, with recomputation, and for
    num_layers or more layers."""
    job, plan = MEGATRON_PLANS["cpu-offload-fsdp-gb200"]
    sc = scenario(**job, **plan)
    (script,) = [w for w in write_all(tmp_path / "o", render_all(sc, ["torchrun"])) if w.suffix == ".sh"]
    (argv, env_value), = run_script(script, tmp_path / "run")
    megatron_validate(megatron, monkeypatch, argv, env_value, arch=10)  # as emitted: accepted
    i = argv.index("--cpu-offloading-num-layers")
    with pytest.raises(ValueError, match="CPU offloading can be done only for layers less than 80"):
        megatron_validate(megatron, monkeypatch, argv[:i + 1] + ["80"] + argv[i + 2:], env_value, arch=10)
    with pytest.raises(ValueError, match="does not work when activation recomputation is enabled"):
        megatron_validate(megatron, monkeypatch, argv + ["--recompute-granularity", "selective"], env_value, arch=10)
    with pytest.raises(ValueError, match="no support for Pipeline parallelism with CPU offloading"):
        megatron_validate(megatron, monkeypatch, argv + ["--pipeline-model-parallel-size", "2"], env_value, arch=10)


def test_torchtitan_profile_accepts_exactly_the_splits_torchtitans_keys_build(torchtitan):
    """Every split torchtitan 0.3.0 builds from its first/last_stage_less_layers keys (its own
    ``_generate_llm_fqn_per_model_part``, looped placement) is legal under the torchtitan profile, and the keys
    plan3d would write for it (``stage_keys``) make torchtitan build the same split again; a split with the same
    stage count that no keys build (one layer moved between middle stages) is refused."""
    from planner.frameworks import get
    from planner.frameworks.torchtitan import stage_keys
    from planner.specs import Plan, chunk_split

    _, _, pipe = torchtitan
    fw = get("torchtitan")

    def their_split(stages, layers, first, last):
        return [sum(n.startswith("layers.") for n in part)
                for part in pipe._generate_llm_fqn_per_model_part(stages, layers, first, last)]

    def problems(ranks, pp, vpp):
        plan = Plan.model_construct(tp=1, pp=pp, dp=1, cp=1, vpp=vpp, micro_batch_size=1,
                                    layers_per_stage=tuple(ranks), pipeline_schedule=None, ep=1, etp=None,
                                    zero_stage=3)
        return [x for x in fw.plan_problems(plan) if x.startswith("layers_per_stage")]

    tried = refused = 0
    for layers, pp, vpp in [(32, 2, 1), (32, 4, 1), (32, 4, 2), (80, 4, 1), (80, 4, 2), (80, 8, 1), (126, 8, 2)]:
        stages = pp * vpp
        for first in range(3):
            for last in range(3):
                split = their_split(stages, layers, first, last)
                ranks = [sum(split[r + c * pp] for c in range(vpp)) for r in range(pp)]
                chunks = chunk_split(ranks, vpp)
                if [chunks[s % pp][s // pp] for s in range(stages)] != split:
                    continue  # per-rank sums a Plan splits into other chunks: not this test's claim
                tried += 1
                assert not problems(ranks, pp, vpp), (layers, pp, vpp, first, last, split)
                per_stage, f, l = stage_keys(layers, pp, vpp, chunks)
                # without layers_per_stage torchtitan makes pp stages for 1F1B, 2 pp for a multi-stage schedule
                made = math.ceil((layers + f + l) / per_stage) if per_stage else pp * (2 if vpp > 1 else 1)
                assert made == stages and their_split(stages, layers, f, l) == split
                if pp > 2 and vpp == 1 and ranks[1] > 1:  # move a layer from stage 1 to stage 2
                    moved = ranks[:1] + [ranks[1] - 1, ranks[2] + 1] + ranks[3:]
                    if all(their_split(stages, layers, a, b) != moved for a in range(6) for b in range(6)):
                        assert problems(moved, pp, vpp), moved
                        refused += 1
    assert tried >= 30 and refused >= 5, (tried, refused)
