"""Launch files and `plan3d check`: round trip, the real consumers, exit codes."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from planner.candidates import SearchSpace
from planner.check import check_file, read_flags
from planner.cli import app
from planner.emit import render_all
from planner.errors import SpecError
from planner.memory import estimate_scenario_memory
from planner.presets import MODEL_DIRNAME, load_hardware, load_model, preset_names
from planner.search import search
from planner.specs import Plan, Scenario, TrainingSpec

DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = {line.strip() for line in (DATA / "megatron_lm_arguments.txt").read_text().splitlines()
                  if line.startswith("--")}
FAST = SearchSpace(max_micro_batch_size=2, max_cp=2)


def _searched(model_name: str, hw_name: str) -> Scenario:
    """The best plan for the model on the smallest power-of-two cluster (from 8 GPUs) where one fits."""
    model, hw = load_model(model_name), load_hardware(hw_name)
    gpus = 8
    while True:
        tr = TrainingSpec(num_gpus=gpus, global_batch_size=2 * gpus, seq_len=min(2048, model.max_seq_len or 2048))
        res = search(model, hw, tr, FAST)
        if res.best is not None:
            return Scenario(model=model, hardware=hw, training=tr, plan=res.best)
        gpus *= 2


def _write(tmp_path, sc, formats):
    files = render_all(sc, formats)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return {name: tmp_path / name for name in files}


@pytest.mark.parametrize("hw_name", ["h100-sxm-80gb", "a100-40gb"])
@pytest.mark.parametrize("model_name", preset_names(MODEL_DIRNAME))
def test_round_trip_search_emit_megatron_check(tmp_path, model_name, hw_name):
    sc = _searched(model_name, hw_name)
    if sc.model.megatron_gaps():  # bloom-176b: ALiBi, which Megatron-LM (core) has no flag for
        with pytest.raises(SpecError, match="alibi|norm|softcap|bias|geglu|parallel"):
            render_all(sc, ["megatron", "torchrun", "slurm"])
        return
    from planner.emit.megatron import moe_plan_refusals

    if moe_plan_refusals(sc):  # a MoE plan Megatron-LM refuses (TP without SP); tests/test_emit_moe.py
        with pytest.raises(SpecError, match="sequence parallelism|etp 1"):
            render_all(sc, ["megatron", "torchrun", "slurm"])
        return
    files = _write(tmp_path, sc, ["megatron", "torchrun", "slurm"])
    for name, path in files.items():
        if name.endswith(".plan.json"):
            continue
        # Megatron's NullTokenizer has --vocab-size + 1 tokens, so the emitter writes V - 1 and the
        # reader adds the end-of-document id back: the same V, the same memory
        assert f"--vocab-size {sc.model.vocab_size - 1}" in path.read_text()
        expected = estimate_scenario_memory(sc)
        result = check_file(path, load_hardware(hw_name), None, None)
        assert not result.errors, result.errors
        got = estimate_scenario_memory(result.scenario)
        assert got.stages == expected.stages, name  # every component of every stage, exactly
        assert result.scenario.resolved_plan() == sc.resolved_plan()


def _llama_scenario(**plan):
    base = dict(tp=8, pp=4, dp=2, micro_batch_size=1, recompute="selective", sequence_parallel=True, zero_stage=1)
    return Scenario(model=load_model("llama3-70b"), hardware=load_hardware("h100-sxm-80gb"),
                    training=TrainingSpec(num_gpus=64, global_batch_size=128, seq_len=8192),
                    plan=Plan(**(base | plan)))


SCENARIOS = {"plain": {}, "uneven": {"layers_per_stage": (19, 21, 21, 19)}, "interleaved": {"vpp": 2},
             "full-recompute-zero0": {"recompute": "full", "zero_stage": 0, "sequence_parallel": False}}


@pytest.mark.parametrize("case", SCENARIOS)
def test_every_megatron_flag_is_in_megatron_lm(tmp_path, case):
    (path,) = _write(tmp_path, _llama_scenario(**SCENARIOS[case]), ["megatron"]).values()
    flags = set(read_flags(path).values)
    assert flags <= MEGATRON_FLAGS, flags - MEGATRON_FLAGS


def test_every_megatron_moe_and_mla_flag_is_in_megatron_lm(tmp_path):
    """MoE with a capacity factor, top-1 routing, a gated shared expert, dense-first layers, EP and ETP; MLA."""
    tiny = load_model("tiny-moe").model_copy(update={"capacity_factor": 1.25, "top_k": 1, "shared_expert_gate": True,
                                                     "attention_sinks": True, "qk_norm": "head"})
    mla = load_model("deepseek-v3").model_copy(update={"num_layers": 4, "first_k_dense": 1})
    for model in (tiny, mla):
        sc = Scenario(model=model, hardware=load_hardware("h100-sxm-80gb"),
                      training=TrainingSpec(num_gpus=8, global_batch_size=16, seq_len=1024),
                      plan=Plan(tp=2, pp=2, dp=2, ep=4, etp=1, micro_batch_size=1, sequence_parallel=True))
        (path,) = _write(tmp_path, sc, ["megatron"]).values()
        flags = set(read_flags(path).values)
        assert {"--num-experts", "--expert-tensor-parallel-size", "--moe-layer-freq"} <= flags
        assert flags <= MEGATRON_FLAGS, flags - MEGATRON_FLAGS


@pytest.mark.parametrize("case", SCENARIOS)
def test_shell_scripts_pass_bash_n_and_shellcheck(tmp_path, case):
    files = _write(tmp_path, _llama_scenario(**SCENARIOS[case]), ["torchrun", "slurm", "torchtitan"])
    scripts = [p for n, p in files.items() if n.endswith((".sh", ".slurm"))]
    assert len(scripts) == 3
    for path in scripts:
        subprocess.run(["bash", "-n", str(path)], check=True)
        if shutil.which("shellcheck") is None:
            pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it)")
        res = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_deepspeed_accepts_its_config(tmp_path, monkeypatch):
    deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (the Makefile installs it)")
    import deepspeed.runtime.config as ds_config

    sc = _llama_scenario(zero_stage=1)
    files = _write(tmp_path, sc, ["deepspeed"])
    (config,) = [p for n, p in files.items() if n.endswith(".deepspeed.json")]

    class DataParallel:  # what Megatron-DeepSpeed's mpu tells DeepSpeed
        def get_data_parallel_world_size(self):
            return sc.plan.dp

        def get_data_parallel_rank(self):
            return 0

    # DeepSpeedConfig asks deepspeed.comm for the rank before it trusts the mpu; answer as rank 0 of a
    # launched job instead of starting one (its CPU backend would compile a kernel first).
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    cfg = ds_config.DeepSpeedConfig(str(config), mpu=DataParallel())
    assert cfg.train_batch_size == 128 and cfg.gradient_accumulation_steps == 64
    assert cfg.zero_optimization_stage == 1 and cfg.bfloat16_config.enabled
    import torch

    # the gradient reduction dtype plan3d costed (grad_reduce_in_bf16 False: fp32), as DeepSpeed reads it
    assert not sc.training.grad_reduce_in_bf16 and cfg.communication_data_type == torch.float32
    bad = json.loads(config.read_text()) | {"train_batch_size": 127}
    with pytest.raises(AssertionError):
        ds_config.DeepSpeedConfig(bad, mpu=DataParallel())
    assert deepspeed.__version__


def _torchtitan_args(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "torchtitan.train" in ln)
    words = shlex.split(line)
    return [w for w in words[words.index("torchtitan.train") + 1:] if w != "$@"]


@pytest.mark.parametrize("case", SCENARIOS)
def test_torchtitan_accepts_its_arguments(tmp_path, case):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (the Makefile installs it)")
    pytest.importorskip("triton", reason="torchtitan's models import triton")
    from torchtitan.config.manager import ConfigManager

    sc = _llama_scenario(**SCENARIOS[case])
    (script,) = _write(tmp_path, sc, ["torchtitan"]).values()
    cfg = ConfigManager().parse_args(_torchtitan_args(script))
    p = cfg.parallelism
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree) == (8, 4, 1)
    assert p.enable_sequence_parallel == sc.plan.sequence_parallel
    assert cfg.training.global_batch_size == 128 and cfg.training.seq_len == 8192
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(_torchtitan_args(script) + ["--parallelism.no_such_option", "1"])


def test_emit_refuses_unsupported_targets(runner, tmp_path):
    sc = _llama_scenario(cp=2, dp=1)
    plan = tmp_path / "plan.json"
    from planner.render import scenario_json

    plan.write_text(scenario_json(sc))
    res = runner.invoke(app, ["emit", str(plan), "--format", "deepspeed", "--out-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and "context parallelism" in res.output
    gpt = Scenario(model=load_model("gpt3-175b"), hardware=load_hardware("a100-80gb"),
                   training=TrainingSpec(num_gpus=64, global_batch_size=64, seq_len=2048),
                   plan=Plan(tp=8, pp=8, dp=1, micro_batch_size=1))
    plan.write_text(scenario_json(gpt))
    res = runner.invoke(app, ["emit", str(plan), "--format", "torchtitan", "--out-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and "torchtitan ships no model" in res.output


def test_emit_cli_names_files_and_never_overwrites(runner, tmp_path):
    from planner.render import scenario_json

    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(_llama_scenario()))
    out = tmp_path / "launch"
    res = runner.invoke(app, ["emit", str(plan), "--format", "megatron,torchrun,slurm", "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in out.iterdir())
    assert names == ["llama3-70b_tp8-pp4-dp2_mbs1.megatron.args", "llama3-70b_tp8-pp4-dp2_mbs1.plan.json",
                     "llama3-70b_tp8-pp4-dp2_mbs1.slurm", "llama3-70b_tp8-pp4-dp2_mbs1.torchrun.sh"]
    slurm = out / "llama3-70b_tp8-pp4-dp2_mbs1.slurm"
    slurm.write_text("# my edits\n")
    res = runner.invoke(app, ["emit", str(plan), "--format", "slurm", "--out-dir", str(out)])
    assert res.exit_code == 2 and "--force" in res.output and slurm.read_text() == "# my edits\n"
    res = runner.invoke(app, ["emit", str(plan), "--format", "slurm", "--out-dir", str(out), "--force"])
    assert res.exit_code == 0 and "#SBATCH --nodes=8" in slurm.read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind


def test_search_emit_writes_launch_files(runner, tmp_path):
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "16",
                              "--global-batch", "64", "--seq-len", "4096", "--emit", "megatron,slurm",
                              "--out-dir", str(tmp_path), "--quiet"])
    assert res.exit_code == 0, res.output
    assert len(list(tmp_path.glob("llama3-8b_*.megatron.args"))) == 1
    assert len(list(tmp_path.glob("llama3-8b_*.slurm"))) == 1


# --- plan3d check -------------------------------------------------------------------------------
REAL_SCRIPT = r"""#!/bin/bash
# Llama-3-70B pretraining on 8 nodes. Kept in our repo and launched by the scheduler.
#SBATCH --nodes=8
#SBATCH --gpus-per-node=8
set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
TP=${TP:-8}
PP=4            # pipeline stages
MBS=1
GBS=128
SEQ=8192

GPT_ARGS="--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 \
    --max-position-embeddings 8192 --position-embedding-type rope --swiglu \
    --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 --vocab-size 128256"

# parallelism
PAR_ARGS=(
    --tensor-model-parallel-size $TP   # NVLink
    --pipeline-model-parallel-size ${PP}
    --sequence-parallel
    --recompute-granularity selective
    --use-distributed-optimizer
)

srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8 \
    pretrain_gpt.py $GPT_ARGS "${PAR_ARGS[@]}" \
    --micro-batch-size $MBS --global-batch-size $GBS --seq-length $SEQ \
    --bf16 --data-path "$DATA" --save "$CKPT"
"""


def test_check_reads_a_real_looking_launch_script(runner, tmp_path):
    script = tmp_path / "train_llama70b.sh"
    script.write_text(REAL_SCRIPT)
    res = runner.invoke(app, ["check", str(script), "--hardware", "h100-sxm-80gb", "--format", "json"])
    assert res.exit_code == 0, res.output
    (r,) = json.loads(res.stdout)
    p = r["plan"]
    assert (p["tp"], p["pp"], p["dp"], p["micro_batch_size"], p["num_microbatches"]) == (8, 4, 2, 1, 64)
    assert (p["recompute"], p["sequence_parallel"], p["zero_stage"]) == ("selective", True, 1)
    # the script keeps Megatron-LM's dataloader attention mask (no --no-create-attention-mask-in-dataloader):
    # 1 x 1 x 8192 x 8192 bools on stage 0, the peak stage (memory.dataloader_mask_bytes)
    sc = _llama_scenario()
    masked = sc.model_copy(update={"training": sc.training.model_copy(update={"attention_mask_in_dataloader": True})})
    expected, without = estimate_scenario_memory(masked), estimate_scenario_memory(sc)
    assert r["memory"]["peak_gib"] == pytest.approx(expected.peak_gib, rel=1e-12)
    assert (expected.peak_gib - without.peak_gib) * 2**30 == pytest.approx(8192 * 8192, rel=1e-9)


def test_check_exit_1_names_file_stage_and_shortfall(runner, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(REAL_SCRIPT.replace("MBS=1", "MBS=4").replace("--recompute-granularity selective", ""))
    res = runner.invoke(app, ["check", str(script), "--hardware", "a100-40gb"])
    assert res.exit_code == 1
    assert "short by" in res.output and "stage 0" in res.output
    gh = runner.invoke(app, ["check", str(script), "--hardware", "a100-40gb", "--format", "github"])
    assert gh.exit_code == 1
    # the annotation points at the first parallelism flag and names the file's stem, the plan, the stage and
    # its ranks (tp 8 x dp 2 = 16 ranks per stage in the order tp-cp-dp-pp)
    assert re.match(rf"::error file={re.escape(str(script))},line=22::train tp8-pp4-dp2_mbs4: stage 0 \(global ranks 0-15\) needs "
                    r"[\d.]+ GiB of [\d.]+ GiB usable \(short by [\d.]+ GiB\)", gh.stdout), gh.stdout


def test_check_exit_2_on_malformed_input(runner, tmp_path):
    cases = {
        "bad-int.sh": REAL_SCRIPT.replace("PP=4 ", "PP=four "),
        "missing.args": "--num-layers 8\n--hidden-size 256\n",
        "quote.sh": REAL_SCRIPT.replace('"$DATA"', '"$DATA'),
        "indivisible.sh": REAL_SCRIPT.replace("#SBATCH --nodes=8", "#SBATCH --nodes=3"),
        "plan.json": '{"model": {}, "hardware": {}, "training": {}, "plan": {"tp": 0}}',
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    for name in cases:
        res = runner.invoke(app, ["check", str(tmp_path / name), "--hardware", "h100-sxm-80gb"])
        assert res.exit_code == 2, (name, res.output)
        assert name in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["check", str(tmp_path / "bad-int.sh"), "--hardware", "h100-sxm-80gb", "--format",
                              "github"])
    assert res.exit_code == 2 and re.search(r"::error file=.*bad-int\.sh,line=23::.*not an integer", res.stdout)
    assert runner.invoke(app, ["check", str(tmp_path / "nope.sh"), "--hardware", "h100-sxm-80gb"]).exit_code == 2


def test_check_plan_file_and_headroom(runner, tmp_path):
    from planner.render import scenario_json

    plan = tmp_path / "plan.json"
    plan.write_text(scenario_json(_llama_scenario()))
    assert runner.invoke(app, ["check", str(plan)]).exit_code == 0
    tight = runner.invoke(app, ["check", str(plan), "--hardware", "h100-sxm-80gb", "--headroom", "0.5"])
    assert tight.exit_code == 1


def test_check_reads_a_plan_file_of_any_name(runner, tmp_path):
    """`plan3d search --out NAME` writes JSON whatever NAME is; check reads it back as the plan it is (not as a
    launch script that needs --hardware), and a script of no suffix is still read as a script."""
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "64", "--seq-len", "4096", "--out", str(tmp_path / "best-plan")])
    assert res.exit_code == 0, res.output
    back = runner.invoke(app, ["check", str(tmp_path / "best-plan")])
    assert back.exit_code == 0 and "fits" in back.output, back.output
    script = tmp_path / "train"
    script.write_text("#!/bin/bash\n{ echo not a plan; }\n")
    assert runner.invoke(app, ["check", str(script)]).exit_code == 2  # a launch file: --hardware is needed


LAYOUTS = {"stored-even-vpp2": {"vpp": 2, "layers_per_stage": (20, 20, 20, 20)},
           "uneven-vpp2": {"vpp": 2, "layers_per_stage": (18, 22, 22, 18)},
           "uneven-middle": {"layers_per_stage": (20, 15, 25, 20)},
           "uneven-middle-vpp2": {"vpp": 2, "layers_per_stage": (20, 16, 24, 20)}}


@pytest.mark.parametrize("case", LAYOUTS)
def test_check_reads_back_every_pipeline_layout(tmp_path, case):
    """Even lists stored in plan files get no uneven flags; uneven middles are a layout, never evened."""
    sc = _llama_scenario(**LAYOUTS[case])
    files = _write(tmp_path, sc, ["megatron", "torchrun", "slurm"])
    for name, path in files.items():
        if name.endswith(".plan.json"):
            continue
        text = path.read_text()
        assert ("--decoder-first-pipeline-num-layers" in text) == (case == "uneven-vpp2"), name
        assert ("--pipeline-model-parallel-layout" in text) == case.startswith("uneven-middle"), name
        result = check_file(path, load_hardware("h100-sxm-80gb"), None, None)
        assert not result.errors, result.errors
        assert result.scenario.resolved_plan() == sc.resolved_plan(), name


def test_layout_strings_in_megatrons_shorthand():
    from planner.emit.megatron import layout_layers, layout_string

    # Megatron's own docstring example form (pipeline_parallel_layer_layout.py): "Ettt|(tt|)*29,m|L"
    assert layout_layers("Et*20|t*15|t*25|t*20L", 4) == ((20, 15, 25, 20), 1)
    assert layout_layers("E|(tt|)*6,L", 2) == ((6, 6), 4)
    assert layout_string((2, 1), 1) == "Ett|tL"
    with pytest.raises(Exception, match="not a multiple"):
        layout_layers("Et|t|tL", 2)


def test_layout_from_a_hostile_file_is_bounded(tmp_path):
    from planner.emit.megatron import layout_layers

    with pytest.raises(Exception, match="repeats more than"):
        layout_layers("E(t|)*999999999999,L", 2)
    with pytest.raises(Exception, match="longer than"):
        layout_layers("E(tttt|)*12000,(tttt|)*12000,L", 2)  # each part allowed, together too long


def test_slurm_script_asks_for_nvlink_segments_on_nvl72(tmp_path):
    """On GB200 NVL72 (trays of 4 GPUs, 72-GPU racks) the script requests the segments the plan's layout assumes
    (Slurm topology/block, ``--segment``): 256 GPUs in 64-GPU segments = 16 nodes; 144 GPUs fill two racks = 18;
    a job inside one rack is one segment; DGX H100 (the domain is the node) gets none. The script still passes
    bash -n and shellcheck."""
    from planner.emit.slurm import segment_nodes

    model = load_model("llama3-70b")

    def scenario(hw, gpus, tp=8):
        return Scenario(model=model, hardware=load_hardware(hw),
                        training=TrainingSpec(num_gpus=gpus, global_batch_size=2 * gpus, seq_len=4096),
                        plan=Plan(tp=tp, pp=1, dp=gpus // tp, micro_batch_size=1, sequence_parallel=True,
                                  zero_stage=1, recompute="full"))

    assert [segment_nodes(scenario("gb200-nvl72", g)) for g in (256, 144, 64, 8)] == [16, 18, 16, 2]
    assert segment_nodes(scenario("h100-sxm-80gb", 256)) is None
    files = _write(tmp_path, scenario("gb200-nvl72", 256), ["slurm"])
    (path,) = [p for n, p in files.items() if n.endswith(".slurm")]
    text = path.read_text()
    assert "#SBATCH --segment=16 " in text and "#SBATCH --nodes=64" in text
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout
