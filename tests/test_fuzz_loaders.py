"""Random and corrupted YAML/JSON documents: each loads or ends in a clean SpecError / exit 2."""

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import app
from planner.presets import SpecError, load_hardware, load_model, load_scenario, preset_dir

SEEDS = [
    (preset_dir("model_specs") / "llama3-8b.yaml").read_text(),
    (preset_dir("model_specs") / "gpt3-175b.yaml").read_text(),
    (preset_dir("hardware_profiles") / "h100-sxm-80gb.yaml").read_text(),
    Path("tests/data/llama3-8b.config.json").read_text(),
]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12))
documents = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                       st.dictionaries(st.text(max_size=10), c, max_size=6)),
                         max_leaves=12)


@st.composite
def corrupted(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(len(text) - 1, 0)))
        op = draw(st.sampled_from(["delete", "insert", "swap", "dup"]))
        if op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 20)):]
        elif op == "insert":
            text = text[:i] + draw(st.text(alphabet=":-[]{}\"'#\n 0123456789abc.,&*!|>", max_size=8)) + text[i:]
        elif op == "swap":
            lines = text.splitlines()
            if len(lines) > 1:
                j, k = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
                lines[j], lines[k] = lines[k], lines[j]
                text = "\n".join(lines)
        else:
            text = text[:i] + text[i:i + 30] + text[i:]
    return text


LOADERS = (load_model, load_hardware, load_scenario)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_all(path):
    for loader in LOADERS:
        try:
            loader(str(path))
        except SpecError as err:
            assert err.lines and all(isinstance(x, str) and x for x in err.lines)


@FUZZ
@given(text=corrupted(), suffix=st.sampled_from([".yaml", ".json"]))
def test_corrupted_documents_load_or_fail_cleanly(tmp_path, text, suffix):
    path = tmp_path / f"doc{suffix}"
    path.write_text(text)
    _load_all(path)


@FUZZ
@given(doc=documents, suffix=st.sampled_from([".yaml", ".json"]))
def test_random_documents_load_or_fail_cleanly(tmp_path, doc, suffix):
    path = tmp_path / f"doc{suffix}"
    path.write_text(json.dumps(doc))
    _load_all(path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=corrupted())
def test_cli_never_shows_a_traceback(tmp_path, text, runner):
    path = tmp_path / "doc.yaml"
    path.write_text(text)
    for args in (["show", str(path)], ["estimate", str(path)]):
        res = runner.invoke(app, args)
        assert res.exit_code in (0, 2), res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


SCRIPT_SEED = Path("tests/test_emit_check.py").read_text().split('REAL_SCRIPT = r"""')[1].split('"""')[0]


@st.composite
def corrupted_script(draw):
    text = SCRIPT_SEED
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(text) - 1))
        op = draw(st.sampled_from(["delete", "insert", "dup"]))
        if op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 15)):]
        elif op == "insert":
            text = text[:i] + draw(st.text(alphabet="\"'$(){}[]#\\\n =-0123456789abcx", max_size=6)) + text[i:]
        else:
            text = text[:i] + text[i:i + 40] + text[i:]
    return text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=corrupted_script())
def test_check_never_shows_a_traceback_on_corrupted_launch_scripts(tmp_path, text, runner):
    path = tmp_path / "train.sh"
    path.write_text(text)
    res = runner.invoke(app, ["check", str(path), "--hardware", "h100-sxm-80gb"])
    assert res.exit_code in (0, 1, 2), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
