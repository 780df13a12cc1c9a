"""Loading specs: bundled presets, our YAML/JSON schema, Hugging Face ``config.json`` and plan files.

Every failure raises :class:`SpecError` whose lines each name the field (or file) and the fix;
the CLI prints them and exits 2. YAML is read with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from planner.errors import SpecError, missing_file  # noqa: F401  (re-exported: planner.presets.SpecError)
from planner.specs import HardwareSpec, ModelSpec, Scenario

T = TypeVar("T", bound=BaseModel)

_PKG = Path(__file__).resolve().parent
MODEL_DIRNAME = "model_specs"
HARDWARE_DIRNAME = "hardware_profiles"


def preset_dir(kind: str) -> Path:
    """The folder of bundled presets: inside the installed package (wheel), else the source tree."""
    for base in (_PKG, _PKG.parent):
        if (base / kind).is_dir():
            return base / kind
    raise SpecError(f"{kind}: bundled presets not found next to {_PKG}; reinstall plan3d")


def preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in preset_dir(kind).glob("*.yaml"))


def validation_lines(err: ValidationError, source: str) -> list[str]:
    """One line per pydantic error: ``source: field.path: message``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        for part in msg.split("\n"):
            prefix = "".join(f"{x}: " for x in (source, loc) if x)
            lines.append(f"{prefix}{part}")
    return lines


def build(cls: type[T], data: Any, source: str) -> T:
    """Validate ``data`` as ``cls``, turning every problem into a SpecError line."""
    if not isinstance(data, dict):
        raise SpecError(f"{source or 'input'}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_lines(err, source)) from None
    except ValueError as err:  # raised by a property used in validation
        raise SpecError(f"{source or 'input'}: {err}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'; keep one of them", key_node.start_mark)
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key '{key}'; keep one of them")
        out[key] = value
    return out


def read_document(path: Path) -> Any:
    """Parse a YAML or JSON file (safe loader), naming the file and line on a syntax error or a duplicate key."""
    if path.is_dir():
        raise SpecError(f"{path}: is a folder; give the path of a YAML or JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read: {err.__class__.__name__}: {err}") from None
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{path}{where}: invalid YAML: {problem}") from None
    except RecursionError:
        raise SpecError(f"{path}: document nested too deeply") from None
    except ValueError as err:  # a duplicate JSON key
        raise SpecError(f"{path}: invalid JSON: {err}") from None


def _resolve(ref: str, kind: str, option: str) -> Path:
    path = Path(ref)
    if path.suffix in (".yaml", ".yml", ".json") or "/" in ref or path.is_dir():
        if path.is_dir():
            raise SpecError(f"{option}: {ref} is a folder; give a preset name or the path of a .yaml/.json file")
        if not path.is_file():
            raise SpecError(f"{option}: {missing_file(ref)}")
        return path
    names = preset_names(kind)
    if ref in names:
        return preset_dir(kind) / f"{ref}.yaml"
    close = difflib.get_close_matches(ref, names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names)}"
    raise SpecError(f"{option}: unknown preset '{ref}'; {hint} (or give a path to a .yaml/.json file)")


#: The figures `plan3d show --json` adds to a spec's own fields (:func:`derived_fields`), each with what it is
#: computed from: a file written from that output loads back, and one whose derived figure was edited is refused,
#: naming the field to edit instead (a derived figure is never an input)
DERIVED_FROM: dict[type, dict[str, str]] = {
    ModelSpec: {"num_params": "the shape fields (num_layers, hidden_size, ffn_hidden_size, vocab_size, ...)",
                "num_active_params": "the shape and expert fields (num_experts, top_k, moe_ffn_hidden_size, ...)",
                "layer_params": "the shape fields (hidden_size, ffn_hidden_size, num_kv_heads, ...)",
                "kv_heads": "num_kv_heads", "ffn_size": "ffn_hidden_size"},
    HardwareSpec: {"usable_memory_gib": "gpu_memory_gib, fragmentation_headroom, cuda_context_gib or "
                                        "nccl_buffers_gib"},
}


def derived_fields(spec: ModelSpec | HardwareSpec) -> dict:
    """What `plan3d show` prints beside a spec's fields: parameter counts, the resolved GQA heads, MLP width and
    head width of a model (``head_dim`` is also a field: its resolved value), the usable memory of a GPU."""
    if isinstance(spec, ModelSpec):
        return {"num_params": spec.num_params, "num_active_params": spec.num_active_params,
                "layer_params": spec.layer_params(), "kv_heads": spec.kv_heads, "ffn_size": spec.ffn_size,
                "head_dim": spec.kv_channels}
    return {"usable_memory_gib": spec.usable_memory_gib}


def build_spec(cls: type[T], data: Any, source: str) -> T:
    """:func:`build` for a model or hardware file, which may also carry the derived figures `plan3d show --json`
    writes (:data:`DERIVED_FROM`); each must agree with the spec the fields make, or the file is refused, one line
    per figure, naming what to edit."""
    derived = DERIVED_FROM[cls]
    given = {k: data[k] for k in derived if k in data} if isinstance(data, dict) else {}
    spec = build(cls, {k: v for k, v in data.items() if k not in given} if given else data, source)
    actual = derived_fields(spec)
    bad = [f"{source}: {k}: {v!r} is derived, not read: the other fields give {actual[k]!r}; edit {derived[k]} "
           f"instead, or remove {k}" for k, v in given.items()
           if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isclose(v, actual[k], rel_tol=1e-9, abs_tol=1e-12))]
    if bad:
        raise SpecError(bad)
    return spec


def load_model(ref: str) -> ModelSpec:
    """A model from a preset name, our YAML/JSON schema (with or without the derived figures of `plan3d show
    --json`), or a Hugging Face ``config.json``."""
    path = _resolve(ref, MODEL_DIRNAME, "--model")
    data = read_document(path)
    if isinstance(data, dict) and is_hf_config(data):
        name = path.parent.name if path.stem == "config" else path.stem.removesuffix(".config")
        data = hf_to_model(data, default_name=name or "model", source=str(path))
        return build(ModelSpec, data, str(path))
    return build_spec(ModelSpec, data, str(path))


def load_hardware(ref: str) -> HardwareSpec:
    """A hardware profile from a preset name or a YAML/JSON file (with or without `plan3d show --json`'s derived
    usable memory)."""
    path = _resolve(ref, HARDWARE_DIRNAME, "--hardware")
    return build_spec(HardwareSpec, read_document(path), str(path))


def load_any(ref: str) -> ModelSpec | HardwareSpec:
    """For `plan3d show`: a model or hardware preset or file, whichever it is."""
    if ref in preset_names(MODEL_DIRNAME):
        return load_model(ref)
    if ref in preset_names(HARDWARE_DIRNAME):
        return load_hardware(ref)
    path = Path(ref)
    if path.is_file():
        data = read_document(path)
        if isinstance(data, dict) and ("gpu_memory_gib" in data or "peak_bf16_tflops" in data):
            return build_spec(HardwareSpec, data, str(path))
        return load_model(ref)
    names = preset_names(MODEL_DIRNAME) + preset_names(HARDWARE_DIRNAME)
    close = difflib.get_close_matches(ref, names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "see `plan3d models` and `plan3d hardware`"
    raise SpecError(f"NAME: '{ref}' is neither a preset nor a file; {hint}")


PLAN_FILE_KEYS = frozenset({"model", "hardware", "training", "plan"})


def plan_document(path: Path) -> Any | None:
    """The parsed document of a plan file (or of part of one, which flags complete), or None for a launch file: a JSON
    or YAML mapping with none of a plan file's keys (a DeepSpeed config, say), or a file of another name that is not a
    plan file's JSON (:func:`planner.check.is_plan_file`: a script, an argument file, a TOML), said before a YAML
    parser errs on it. Shared by ``plan3d estimate`` (which reads launch files too) and the plan-only commands."""
    if path.suffix not in (".json", ".yaml", ".yml"):
        from planner.check import is_plan_file

        if not is_plan_file(path):
            return None
    doc = read_document(path)
    return None if isinstance(doc, dict) and not doc.keys() & PLAN_FILE_KEYS else doc


def load_scenario(path_str: str, hardware: HardwareSpec | None = None) -> Scenario:
    """A plan file: ``{model, hardware, training, plan}`` as `plan3d search --out` writes it; with ``hardware``, the
    file's plan on that profile instead of its own, built and validated once, there."""
    path = Path(path_str)
    if not path.is_file():
        raise SpecError(f"PLAN: {missing_file(path_str)}")
    data = plan_document(path)
    if data is None:
        raise SpecError(f"{path}: not a plan file (the JSON or YAML of model, hardware, training and plan that "
                        f"`plan3d search --out` writes); `plan3d estimate {path} --hardware H` and `plan3d check` "
                        "read launch files")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with keys model, hardware, training, plan")
    if hardware is not None:
        data = {**data, "hardware": hardware.model_dump(mode="json")}
    return build(Scenario, data, str(path))


# --- Hugging Face config.json (read in planner/hf.py) -------------------------------------------

_HF_ARCH_KEYS = ("model_type", "architectures")


def is_hf_config(data: dict) -> bool:
    return any(k in data for k in _HF_ARCH_KEYS) or "n_embd" in data or "num_hidden_layers" in data


def hf_to_model(data: dict, default_name: str, source: str) -> dict:
    """Map a Hugging Face ``config.json`` to ModelSpec fields exactly, or refuse it with one line
    (see :mod:`planner.hf`)."""
    from planner.hf import hf_fields  # planner.hf imports SpecError from this module

    try:
        return hf_fields(data, default_name, source)
    except (TypeError, ValueError, AttributeError) as err:
        raise SpecError(f"{source}: unreadable Hugging Face config value: {err}") from None
