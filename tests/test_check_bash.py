"""planner/readers/bash.py: expansions as bash performs them. Each expected value is what bash itself
prints for the same script (checked with bash where it is installed: test_agrees_with_bash)."""

import shutil
import subprocess

import pytest

from planner.presets import SpecError
from planner.readers.bash import evaluate, is_unknown, unknown_sources


def _argv(script: str, **env) -> list[list[str]]:
    """The argv of the last `run` command in each World."""
    out = []
    for w in evaluate(script, "t.sh", env=env):
        cmds = [c for c in w.commands if c.argv[0] == "run"]
        if cmds and not w.exited:
            out.append(cmds[-1].argv[1:])
    return out


# (script, the words `run` receives): what bash gives.
CASES = {
    "quoted array entry stays one word": ('A=("--fp8-format hybrid" --x)\nrun "${A[@]}"', ["--fp8-format hybrid", "--x"]),
    "unquoted array entry splits": ('A=("--fp8-format hybrid" --x)\nrun ${A[@]}', ["--fp8-format", "hybrid", "--x"]),
    "array append": ('A=(--a 1)\nA+=(--b "2 3")\nrun "${A[@]}" ${#A[@]}', ["--a", "1", "--b", "2 3", "4"]),
    "arithmetic": ('N=8\nM=$((N * 2 + 1))\nrun $M $(( (N - 11) / 2 )) $(( -7 % 3 )) $((N**2))', ["17", "-1", "-1", "64"]),
    "multi-line string with continuations": ('S="--a 1 \\\n   --b 2"\nrun $S "$S"', ["--a", "1", "--b", "2", "--a 1    --b 2"]),
    "defaults": ('run ${X:-7} ${X-8} "${1:-first}" ${Y:=9} $Y', ["7", "8", "first", "9", "9"]),
    "empty unquoted vanishes": ('E=\nrun a $E b "$E"', ["a", "b", ""]),
    "trim": ('F=config/train.toml\nrun ${F%.toml} ${F##*/} ${F#*/}', ["config/train", "train.toml", "train.toml"]),
    "single quotes keep dollars": ("run '$X' \"a'b\"", ["$X", "a'b"]),
    "decided if": ('T=fp8\nif [[ "$T" == "fp8" ]]; then A=1; elif [ "$T" = bf16 ]; then A=2; else A=3; fi\nrun $A', ["1"]),
    "decided case with glob": ('S=70b\ncase $S in\n 7b) A=small;;\n 70*|405*) A=big;;\nesac\nrun $A', ["big"]),
    "no arguments: while $# loop": ('while [ $# -gt 0 ]; do shift; A=1; done\nrun ${A:-none}', ["none"]),
    "for over a list": ('A=()\nfor x in 1 2 3; do A+=(--l$x); done\nrun "${A[@]}"', ["--l1", "--l2", "--l3"]),
    "functions": ('f() { run "$1" --in-f; }\nf hello', ["hello", "--in-f"]),
    "(( )) condition": ('N=3\nif (( N > 2 )); then A=big; else A=small; fi\nrun $A', ["big"]),
    "|| skips the right side": ('cd /x || exit 1\nrun ok', ["ok"]),
    # tree-sitter-bash hands the space before `${D}` (and the `\\<newline>` before `$W`) to the `$` token:
    # the gap is the string's, not lost (Megatron-DeepSpeed's run_cmd="deepspeed $WORKER_STR ${DIR}/pretrain_gpt.py")
    "expansions after expansions in a string": ('W="--n 8"\nD=/d\nR="x $W ${D}/p $W \\\n  $W"\nrun $R "$R"',
                                                ["x", "--n", "8", "/d/p", "--n", "8", "--n", "8",
                                                 "x --n 8 /d/p --n 8   --n 8"]),
    # tree-sitter-bash 0.25 ends the word at `/$` and reads `D/x` as a command (run_llama_bf16.sh's
    # CHECKPOINT_PATH=${EXP_DIR}/checkpoints/llama/z${ZERO_STAGE}/$DTYPE/tp${TP}...)
    "$NAME after ${NAME} in one word": ("Z=z\nD=d\nC=${Z}/$D/x\nrun $C ${Z}/$D/y '${Z}/$D'", ["z/d/x", "z/d/y", "${Z}/$D"]),
    "backslash-newline at the end of the file": ("run a \\\n    b \\\n", ["a", "b"]),
    # "$@" with no arguments and "${A[@]}" of an empty array are no word at all, "$*" is one empty word: plan3d's own
    # torchrun script ends `"${MEGATRON_ARGS[@]}" "$@"`, and an empty word there was read as a value of the last flag
    # (its --cuda-graph-scope, nargs '+', then refused)
    "empty \"$@\" and \"${A[@]}\" vanish": ('B=()\nrun a "$@" "${@}" "${B[@]}" "$*" "x$@" "${B[*]}" "${B}" "$B" z',
                                         ["a", "", "x", "", "", "", "z"]),
}


@pytest.mark.parametrize("name", CASES)
def test_expansion(name):
    script, want = CASES[name]
    assert _argv(script) == [want]


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("no arguments: while $# loop",)])
def test_agrees_with_bash(name, tmp_path):
    """The same script run by bash, `run` printing its arguments one per line (NUL-separated)."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    script, want = CASES[name]
    prog = "run() { printf '%s\\0' \"$@\"; }\n" + script.replace("cd /x || exit 1", "cd / || exit 1")
    out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.split("\0")[:-1] == want


def test_environment_branches_fork():
    script = 'if [ "${SIZE:-small}" = big ]; then L=80; else L=32; fi\nrun $L'
    assert sorted(_argv(script)) == [["32"], ["80"]]
    worlds = evaluate(script, "t.sh")
    assert [w.branch for w in worlds] == [['line 1: if [ "${SIZE:-small}" = big ]'], ["line 1: else"]]


def test_case_on_unset_variable_forks_and_keeps_the_exit():
    script = "case $M in\n a) X=1;;\n b) X=2;;\n *) exit 1;;\nesac\nrun $X"
    worlds = evaluate(script, "t.sh")
    assert [w.exited for w in worlds] == [False, False, True]
    assert _argv(script) == [["1"], ["2"]]


def test_variable_set_from_environment_taints_conditions():
    assert sorted(_argv('TP=${TP:-8}\nif [ "$TP" -gt 1 ]; then S=--sp; fi\nrun ${S:-none}')) == [["--sp"], ["none"]]
    # a positional parameter is not the environment: the script runs with no arguments
    assert _argv('X=$3\nif [ -z "$X" ]; then A=1; else A=2; fi\nrun $A') == [["1"]]


def test_unknown_values_carry_their_source():
    ((word, sub),) = _argv("run $DATA $(hostname)")
    assert is_unknown(word) and unknown_sources(word) == ["$DATA"]
    assert unknown_sources(sub) == ["$(hostname)"]


def test_here_document_is_recorded_with_expansions():
    script = 'GBS=64\nCFG=./ds.json\ncat <<EOT > $CFG\n{"train_batch_size": $GBS}\nEOT\ncat <<\'EOF\' > raw.txt\n$GBS\nEOF\n'
    (w,) = evaluate(script, "t.sh")
    assert w.files == {"./ds.json": '{"train_batch_size": 64}\n', "raw.txt": "$GBS\n"}


def test_bash_c_and_eval_are_evaluated():
    assert _argv('CMD="run --a 1"\nsrun bash -c "$CMD"') == [["--a", "1"]]
    assert _argv('eval run --b 2') == [["--b", "2"]]


def test_eval_with_an_unknown_piece_is_read_with_that_piece_unknown():
    # microsoft/Megatron-DeepSpeed universal_checkpointing/run_llama_bf16.sh: DIR=`pwd`, eval ${run_cmd}
    script = 'DIR=`pwd`\nW="--num_gpus 8"\nrun_cmd="run $W ${DIR}/pretrain_gpt.py --tp 2"\neval ${run_cmd}\n'
    ((n, gpus, path, flag, tp),) = _argv(script)
    assert (n, gpus, flag, tp) == ("--num_gpus", "8", "--tp", "2")
    assert unknown_sources(path) == ["`pwd`"] and path.endswith("/pretrain_gpt.py")
    (w,) = evaluate(script, "t.sh")
    assert w.commands[-1].line == 4  # the eval's line, not line 1 of the evaluated string
    assert not any(k.startswith("__plan3d") for k in w.env)


def test_unquoted_expansion_splits_around_an_unknown_piece():
    # Megatron-LM examples/deepseek2_lite: DATA_ARGS_LIST+=("--data-cache-path ${DATA_CACHE_PATH}") with
    # DATA_CACHE_PATH="${PWD}/cache", expanded unquoted: two words, whatever $PWD holds
    ((flag, path, last),) = _argv('C="${PWD}/cache"\nA=("--data-cache-path ${C}")\nrun ${A[@]} "x y"')
    assert flag == "--data-cache-path" and unknown_sources(path) == ["$PWD"] and path.endswith("/cache")
    assert last == "x y"
    ((word,),) = _argv("run $(date +%Y %m)")  # blanks inside an unknown piece do not split it
    assert unknown_sources(word) == ["$(date +%Y %m)"]


def test_substring_with_a_dollar_offset_parses():
    # ROCm Megatron-LM examples/llama/train_llama2.sh: VALUE="${ARGUMENT:$KEY_LENGTH+1}" (bash -n accepts it)
    ((word,),) = _argv('A=hello\nK=1\nV="${A:$K+1}"\nrun "$V"')
    assert word == "llo" or is_unknown(word)  # bash gives "llo"; an unevaluated substring must say it is unknown


def test_c_style_for_loop_leaves_what_it_sets_unknown():
    # Megatron-DeepSpeed's checkpoint-pointer loop: for (( node = 0; node <= num_node-1; node++ )); do ... done
    script = "iteration=0\nfor (( node = 0; node <= 1; node++ ))\ndo\n  iteration=$((iteration + 1))\ndone\nrun $iteration x"
    ((it, x),) = _argv(script)
    assert is_unknown(it) and x == "x"
    with pytest.raises(SpecError, match="C-style for loop"):
        evaluate("for (( i = 0; i < 2; i++ )); do\n  torchrun pretrain_gpt.py --num-layers $i\ndone\n", "t.sh")


def test_word_lines_point_at_their_source():
    script = "A=(\n  --x 1\n  --y 2\n)\nrun \\\n  \"${A[@]}\" --z 3\n"
    (w,) = evaluate(script, "t.sh")
    cmd = w.commands[-1]
    assert list(zip(cmd.argv, cmd.lines)) == [("run", 5), ("--x", 2), ("1", 2), ("--y", 3), ("2", 3), ("--z", 6),
                                              ("3", 6)]


def test_syntax_error_is_one_line_with_its_line():
    with pytest.raises(SpecError) as err:
        evaluate("A=1\nif [ x ]; then\n  run\n", "bad.sh")
    assert err.value.lines[0].startswith("bad.sh:") and "bash" in err.value.lines[0]


def test_too_many_branch_combinations_are_refused():
    script = "".join(f'if [ "$V{i}" = 1 ]; then A{i}=1; fi\n' for i in range(7)) + "run x\n"
    with pytest.raises(SpecError, match="combinations"):
        evaluate(script, "t.sh")


ARITH_COMMANDS = {
    "(( N = N * 4 ))": ("N=2\n(( N = N * 4 ))\nrun $N", ["8"]),
    "(( N += 3 )) and ++": ("N=2\n(( N += 3 ))\n((N++))\nrun $N", ["6"]),
    "let": ("N=2\nlet M=N+1 'K = M * 2'\nrun $M $K", ["3", "6"]),
}


@pytest.mark.parametrize("name", ARITH_COMMANDS)
def test_arithmetic_commands(name):
    script, want = ARITH_COMMANDS[name]
    assert _argv(script) == [want]
    if shutil.which("bash"):
        out = subprocess.run(["bash", "-c", "run() { printf '%s\\0' \"$@\"; }\n" + script], capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin"})
        assert out.stdout.split("\0")[:-1] == want


def test_source_reads_a_file_next_to_the_script(tmp_path):
    (tmp_path / "config.sh").write_text("TP=4\nARGS=(--tp $TP)\n")
    script = tmp_path / "train.sh"
    script.write_text("source ./config.sh\nrun \"${ARGS[@]}\" $MISSING\n. ./absent.sh\n")
    (w,) = evaluate(script.read_text(), str(script))
    (run,) = [c for c in w.commands if c.argv[0] == "run"]
    assert run.argv[:3] == ["run", "--tp", "4"] and is_unknown(run.argv[3])
