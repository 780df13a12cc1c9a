"""Issue 17: every bad input is one line and exit 2, outputs stay where they were asked, nothing hangs,
tables fit the terminal. The corpus names each case the fuzz pass of the issue found, and more."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import app
from planner.presets import load_hardware, load_model

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--global-batch", "64", "--seq-len", "4096"]
EST = ["estimate", *JOB, "--gpus", "16", "--tp", "2", "--pp", "2"]


def _plan_file(tmp_path: Path, **plan) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "model": load_model("llama3-8b").model_dump(), "hardware": load_hardware("h100-sxm-80gb").model_dump(),
        "training": {"num_gpus": 16, "global_batch_size": 64, "seq_len": 4096},
        "plan": {"tp": 2, "pp": 2, "dp": 4, "micro_batch_size": 1, "num_microbatches": 16,
                 "layers_per_stage": [16, 16]} | plan}))
    return path


def _clean_failure(res, code: int = 2) -> list[str]:
    """Exit ``code``, no traceback, and the error lines (each 'error: ...')."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output, res.output
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert lines, res.output
    return lines


# --- the corpus -----------------------------------------------------------------------------------
def test_emit_out_dir_is_a_file(runner, tmp_path):
    plan, target = _plan_file(tmp_path), tmp_path / "afile"
    target.write_text("keep me")
    lines = _clean_failure(runner.invoke(app, ["emit", str(plan), "--out-dir", str(target)]))
    assert "--out-dir" in lines[0] and "is a file" in lines[0]
    assert target.read_text() == "keep me"


def test_report_out_is_a_file(runner, tmp_path):
    plan, target = _plan_file(tmp_path), tmp_path / "afile"
    target.write_text("keep me")
    lines = _clean_failure(runner.invoke(app, ["report", str(plan), "--out", str(target), "--quiet"]))
    assert "--out" in lines[0] and target.read_text() == "keep me"


@pytest.mark.parametrize("target", ["/proc/plan3d-test/plan.json", "/proc/plan3d-test.json"])
def test_out_where_nothing_can_be_written(runner, target):
    lines = _clean_failure(runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", target, "--quiet"]))
    assert lines[0].startswith("error: --out:")


def test_out_is_a_folder_even_with_force(runner, tmp_path):
    lines = _clean_failure(runner.invoke(app, ["search", *JOB, "--gpus", "8", "--out", str(tmp_path), "--force",
                                               "--quiet"]))
    assert "is a folder" in lines[0]


def test_read_only_folder(runner, tmp_path):
    if os.geteuid() == 0:  # root writes through file modes; a read-only bind mount is not available here
        ro = Path("/proc/self")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
    lines = _clean_failure(runner.invoke(app, ["emit", str(_plan_file(tmp_path)), "--out-dir", str(ro)]))
    assert "--out-dir" in lines[0]


@pytest.mark.parametrize("field,value,needle", [
    ("gpu_memory_gib", float("inf"), "gpu_memory_gib"),
    ("gpu_memory_gib", float("nan"), "gpu_memory_gib"),
    ("gpu_memory_gib", 1.0, "usable"),               # context + NCCL buffers leave nothing
    ("peak_bf16_tflops", float("inf"), "peak_bf16_tflops"),
    ("gpus_per_node", 10**9, "gpus_per_node"),
])
def test_profile_values_without_physical_meaning(runner, tmp_path, field, value, needle):
    hw = load_hardware("h100-sxm-80gb").model_dump() | {field: value}
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(hw))
    lines = _clean_failure(runner.invoke(app, ["estimate", "--model", "llama3-8b", "--hardware", str(path), "--gpus",
                                               "8", "--global-batch", "8", "--seq-len", "4096", "--tp", "8", "--pp",
                                               "1"]))
    assert any(needle in line for line in lines), lines


@pytest.mark.parametrize("gpus", ["1000000000000", "64..1000000000000", "8,2000000"])
def test_huge_gpu_counts_answer_at_once(runner, gpus):
    t0 = time.perf_counter()
    lines = _clean_failure(runner.invoke(app, ["search", *JOB, "--gpus", gpus, "--quiet"]))
    assert time.perf_counter() - t0 < 5
    assert "--gpus" in lines[0] and "1,000,000" in lines[0]


def test_estimate_huge_gpus_bounded(runner):
    lines = _clean_failure(runner.invoke(app, ["estimate", *JOB, "--gpus", "1000000000000", "--tp", "1", "--pp", "1"]))
    assert "--gpus" in lines[0]


@pytest.mark.parametrize("gpus", ["abc", "64..", "..64", "0", "-8", "64..8", ""])
def test_bad_gpu_counts(runner, gpus):
    lines = _clean_failure(runner.invoke(app, ["search", *JOB, "--gpus", gpus, "--quiet"]))
    assert "--gpus" in lines[0]


def test_plan_file_override_gpus_rederives(runner, tmp_path):
    plan = _plan_file(tmp_path)
    res = runner.invoke(app, ["estimate", str(plan), "--gpus", "32", "--json"])
    assert res.exit_code in (0, 1), res.output
    d = json.loads(res.stdout)
    assert (d["plan"]["dp"], d["plan"]["num_microbatches"]) == (8, 8)  # 32 / (2*2); 64 / (1*8)


def test_plan_file_override_global_batch_rederives(runner, tmp_path):
    res = runner.invoke(app, ["estimate", str(_plan_file(tmp_path)), "--global-batch", "128", "--json"])
    assert res.exit_code in (0, 1), res.output
    assert json.loads(res.stdout)["plan"]["num_microbatches"] == 32  # 128 / (1*4)


def test_plan_file_override_pp_drops_the_files_split(runner, tmp_path):
    res = runner.invoke(app, ["estimate", str(_plan_file(tmp_path)), "--pp", "4", "--json"])
    assert res.exit_code in (0, 1), res.output
    assert json.loads(res.stdout)["plan"]["layers_per_stage"] == [8, 8, 8, 8]


def test_plan_file_override_conflict_names_the_pinned_knobs(runner, tmp_path):
    lines = _clean_failure(runner.invoke(app, ["estimate", str(_plan_file(tmp_path)), "--gpus", "6"]))
    assert "tp(2) * pp(2)" in lines[0] and "--tp/--pp/--cp" in lines[0]


def test_duplicate_yaml_key(runner, tmp_path):
    text = (ROOT / "model_specs" / "llama3-8b.yaml").read_text() + "\nnum_layers: 40\n"
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    lines = _clean_failure(runner.invoke(app, ["show", str(path)]))
    assert "duplicate key 'num_layers'" in lines[0]


def test_duplicate_json_key(runner, tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"name": "x", "name": "y"}')
    lines = _clean_failure(runner.invoke(app, ["show", str(path)]))
    assert "duplicate key 'name'" in lines[0]


@pytest.mark.parametrize("argv", [
    ["show", "{d}"],
    ["estimate", "--model", "{d}", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--global-batch", "8",
     "--seq-len", "4096", "--tp", "8", "--pp", "1"],
    ["estimate", "{d}"],
    ["emit", "{d}"],
])
def test_folder_given_as_a_file(runner, tmp_path, argv):
    lines = _clean_failure(runner.invoke(app, [a.format(d=tmp_path) for a in argv]))
    assert "folder" in lines[0], lines


def test_tp_that_straddles_nodes(runner):
    lines = _clean_failure(runner.invoke(app, ["estimate", *JOB, "--gpus", "24", "--tp", "3", "--pp", "1"]))
    assert any("NVLink domain (8 GPUs)" in line for line in lines)
    lines = _clean_failure(runner.invoke(app, ["search", *JOB, "--gpus", "24", "--tp", "3", "--quiet"]))
    assert "--tp" in lines[0] and "NVLink domain (8 GPUs)" in lines[0]


def test_estimate_exit_codes(runner):
    assert runner.invoke(app, EST).exit_code == 0
    res = runner.invoke(app, ["estimate", "--model", "gpt3-175b", "--hardware", "a100-80gb", "--gpus", "16",
                              "--global-batch", "64", "--seq-len", "2048", "--tp", "8", "--pp", "2"])
    assert res.exit_code == 1 and "does NOT fit" in res.output


def test_report_refuses_to_overwrite_and_keeps_what_was_there(runner, tmp_path):
    plan, out = _plan_file(tmp_path), tmp_path / "rep"
    assert runner.invoke(app, ["report", str(plan), "--out", str(out), "--quiet"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "report.html" in before and "timeline.png" in before
    lines = _clean_failure(runner.invoke(app, ["report", str(plan), "--out", str(out), "--quiet"]))
    assert "--force" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert runner.invoke(app, ["report", str(plan), "--out", str(out), "--quiet", "--force"]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging folder left behind


# --- names that must not escape -------------------------------------------------------------------
HOSTILE = ["Qwen/Qwen2.5-7B", "../../escaped", "/abs/escaped", "$(touch PWNED)", "`touch PWNED`", "a\nb; touch PWNED",
           "'; touch PWNED; '", '"; touch PWNED; "', "..", "-rf"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_model_name_stays_in_out_dir(runner, tmp_path, name):
    spec = load_model("llama3-8b").model_dump() | {"name": name}
    model = tmp_path / "model.json"
    model.write_text(json.dumps(spec))
    out = tmp_path / "nested" / "launch"
    res = runner.invoke(app, ["search", "--model", str(model), "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "4096", "--emit", "megatron,torchrun,slurm",
                              "--out-dir", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    everything = {p for p in tmp_path.rglob("*")}
    written = {p for p in everything if p.is_file() and p != model}
    assert written and all(out in p.parents for p in written), sorted(map(str, written))
    assert not (tmp_path / "PWNED").exists()


# --- hypothesis: random command lines -------------------------------------------------------------
VALUES = st.one_of(st.integers(-5, 5000).map(str), st.sampled_from(["0", "-1", "1e9", "1000000000000", "nan", "inf",
                                                                   "", "abc", "64..8", "8..64", "3,5", "llama3-8b",
                                                                   "h100-sxm-80gb", "gpt3-175b", "/nonexistent.yaml",
                                                                   "selective", "bogus", "1,2,3", "../x"]))
OPTIONS = ["--model", "--hardware", "--gpus", "--global-batch", "--seq-len", "--tp", "--pp", "--vpp", "--cp",
           "--micro-batch-size", "--recompute", "--zero-stage", "--precision", "--attention", "--framework",
           "--layers-per-stage", "--top"]
FLAGS = ["--sequence-parallel", "--no-sequence-parallel", "--json", "--quiet", "--exhaustive"]


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(["estimate", "search", "show", "check"]))
    argv = [cmd]
    base = dict(zip(["--model", "--hardware", "--gpus", "--global-batch", "--seq-len"],
                    ["llama3-8b", "h100-sxm-80gb", "16", "64", "4096"]))
    for opt in draw(st.lists(st.sampled_from(OPTIONS), max_size=6, unique=True)):
        base[opt] = draw(VALUES)
    if cmd == "show":
        return ["show", draw(VALUES)]
    if cmd == "check":
        return ["check", draw(VALUES), "--hardware", base["--hardware"]]
    for opt, val in base.items():
        argv += [opt, val]
    argv += draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))
    return argv


@settings(max_examples=80, deadline=None, derandomize=True,  # the same cases in every CI run
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=command_lines())
def test_cli_fuzz_no_traceback_bounded_time(runner, argv):
    if argv[0] == "search" and "--exhaustive" in argv:
        argv.remove("--exhaustive")  # brute force is slow by design; the solver is what users run
    t0 = time.perf_counter()
    res = runner.invoke(app, argv)
    elapsed = time.perf_counter() - t0
    assert res.exception is None or isinstance(res.exception, SystemExit), (argv, repr(res.exception))
    assert "Traceback" not in res.output
    assert res.exit_code in (0, 1, 2, 3), (argv, res.exit_code, res.output)
    if res.exit_code == 2:
        assert res.output.strip(), argv
    assert elapsed < 5, (argv, elapsed)


# --- terminal width -------------------------------------------------------------------------------
def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("argv", [EST, ["search", *JOB, "--gpus", "16", "--top", "2"]])
def test_tables_fit_the_terminal(runner, monkeypatch, columns, argv):
    monkeypatch.setenv("COLUMNS", str(columns))
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert _widest(res.stdout) <= columns
    assert ("of usable" in res.stdout) == (columns >= 100)  # the compact memory table drops that column


@pytest.mark.parametrize("columns", [80, 120])
def test_check_shows_whole_file_names(runner, monkeypatch, tmp_path, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    folder = tmp_path / "a-rather-long-folder-name-for-launch-files"
    folder.mkdir()
    names = []
    for i in (1, 2):
        p = _plan_file(tmp_path)
        name = folder / f"llama3-8b_tp2-pp2-dp4_mbs1.variant-number-{i}.plan.json"
        p.rename(name)
        names.append(name)
    res = runner.invoke(app, ["check", *map(str, names), "--hardware", "h100-sxm-80gb"])
    assert res.exit_code == 0, res.output
    assert _widest(res.stdout) <= columns
    flat = "".join(line.strip("│ ") for line in res.stdout.splitlines())
    for name in names:
        assert f"variant-number-{name.stem[-6]}" in flat or name.name.split(".")[1] in flat
    assert "…" not in res.stdout


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("cmd", [[], ["search"], ["estimate"], ["check"]])
def test_help_fits_and_does_not_wrap_word_by_word(columns, cmd):
    env = os.environ | {"COLUMNS": str(columns)}
    res = subprocess.run([sys.executable, "-m", "planner.cli", *cmd, "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    assert _widest(res.stdout) <= columns
    # the failure the issue shows at 80 columns: option help squeezed to one word per line. A
    # wrapped paragraph may end in one word; two single-word lines in a row mean a squeezed column.
    run = worst = 0
    for line in res.stdout.splitlines():
        text = line.strip(" │")
        lonely = len(text.split()) == 1 and not text.endswith(":") and not text.startswith(("-", "╭", "╰", "─"))
        run = run + 1 if lonely else 0
        worst = max(worst, run)
    assert worst <= 1, res.stdout


# --- structure ------------------------------------------------------------------------------------
def test_cli_package_has_no_import_cycle():
    """Edges between planner.cli modules (module level and inside functions) form no cycle."""
    folder = ROOT / "planner" / "cli"
    mods = {p.stem for p in folder.glob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods:
        tree = ast.parse((folder / f"{m}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("planner.cli."):
                    edges[m].add(node.module.split(".")[2])
                elif node.module == "planner.cli":
                    edges[m] |= {a.name for a in node.names if a.name in mods} or {"__init__"}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("planner.cli."):
                        edges[m].add(a.name.split(".")[2])
    assert not (ROOT / "planner" / "cli.py").exists() and not (ROOT / "planner" / "cli_ops.py").exists()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges.get(m, ()):
            assert state.get(n) != 1, f"import cycle: {' -> '.join(path + [n])}"
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_emit_refuses_a_model_megatron_cannot_build(runner, tmp_path):
    """A Gemma-2-style model (sandwich norms, soft-capping) has no Megatron-LM flags: refused, nothing written."""
    spec = load_model("llama3-8b").model_dump() | {"norm_placement": "sandwich", "final_logit_softcap": 30.0}
    model = tmp_path / "model.json"
    model.write_text(json.dumps(spec))
    out = tmp_path / "launch"
    res = runner.invoke(app, ["search", "--model", str(model), "--hardware", "h100-sxm-80gb", "--gpus", "8",
                              "--global-batch", "8", "--seq-len", "4096", "--emit", "torchrun", "--out-dir", str(out),
                              "--quiet"])
    lines = _clean_failure(res)
    assert any("norm_placement" in line for line in lines) and any("final_logit_softcap" in line for line in lines)
    assert not out.exists() or not any(out.iterdir())


def test_a_pin_that_leaves_no_micro_batch_is_no_plan_not_a_crash(runner):
    """Found by the fuzz test: a micro-batch size dividing no replica's batch left the search's tables
    empty and numpy refused the mask; now it is 'no legal plan', exit 3."""
    res = runner.invoke(app, ["search", *JOB, "--gpus", "16", "--micro-batch-size", "3"])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 3 and "no legal plan" in res.output


def test_estimate_notes_an_mfu_above_every_published_run(runner):
    """A100 80GB bf16: the best published MFU is 62.7 % (llm-foundry's MPT-3B run, planner/sanity.py)."""
    from planner.sanity import mfu_note

    assert mfu_note("a100-80gb", "bf16", 0.63) is not None and mfu_note("a100-80gb", "bf16", 0.62) is None
    assert mfu_note("mi300x-192gb", "bf16", 0.99) is None  # no published figure to compare with
    # GB200 NVFP4: 2,891 of 10,000 TFLOP/s, Megatron-Bridge 26.02's Llama 3.1 405B row
    assert mfu_note("gb200-nvl72", "nvfp4", 0.30) is not None and mfu_note("gb200-nvl72", "nvfp4", 0.28) is None
    res = runner.invoke(app, EST)
    mfu = json.loads(runner.invoke(app, [*EST, "--json"]).stdout)["time"]["mfu"]
    assert ("above the best published" in res.stdout) == (mfu > 0.47)


def test_an_error_quoting_a_multi_line_value_stays_one_line(runner, tmp_path):
    """A value of the user's file that holds line breaks (a TOML multi-line string) is quoted in the error with the
    breaks escaped (``errors.one_line``, applied to every SpecError line): before 2026-12-05 only the Megatron
    argument reader escaped them, and a torchtitan schedule written over two lines gave a two-line error."""
    from planner.errors import SpecError

    assert SpecError("a\nb\r\x1b[0m\u2028c").lines == ["a\\nb\\r\\x1b[0m\\u2028c"]
    text = (ROOT / "tests/data/launch/torchtitan_llama3_70b_pp.toml").read_text()
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("pipeline_parallel_schedule"))
    lines[at] = 'pipeline_parallel_schedule = """Inter\nleaved"""'
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    res = runner.invoke(app, ["check", str(path), "--hardware", "h100-sxm-80gb"], env={"COLUMNS": "400"})
    (line,) = _clean_failure(res)
    assert "Inter\\nleaved" in line and not any(x.startswith("leaved") for x in res.output.splitlines())
