"""torchtitan job configs (TOML, ``--section.key`` overrides) -> a plan3d scenario.

Keys and defaults are torchtitan's ``JobConfig`` (``torchtitan/config/job_config.py`` in the TOML
releases, ``torchtitan/config/configs.py`` in 0.3): ``[model] name/flavor/converters``,
``[training] local_batch_size`` (``batch_size`` before 2025), ``global_batch_size`` (-1: local x dp),
``seq_len``; ``[parallelism] data_parallel_replicate_degree`` (1), ``data_parallel_shard_degree`` (-1:
the ranks left over), ``tensor_parallel_degree``, ``pipeline_parallel_degree``,
``pipeline_parallel_microbatch_size`` (1), ``context_parallel_degree``; ``[activation_checkpoint] mode``.
Overrides on the command line win over the TOML (torchtitan's ConfigManager: "CLI args > TOML").
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from planner.frameworks.torchtitan import ASYNC_TP_CONFIGS, step_cuda_graph_by_default
from planner.presets import SpecError, load_model
from planner.schedules import TORCHTITAN_SCHEDULE_NAMES

# torchtitan model (name, flavor) or config-registry function -> plan3d preset.
# torchtitan/models/llama3/__init__.py llama3_configs "8B"/"70B"/"405B" are Llama 3.1 (max_seq_len 131072 with
# rope scaling); torchtitan/models/llama2 (2024 releases) "7B"/"13B"/"70B".
PRESETS = {
    ("llama3", "8b"): "llama3-8b", ("llama3", "70b"): "llama3-70b", ("llama3", "405b"): "llama3-405b",
    ("llama2", "7b"): "llama2-7b", ("llama2", "13b"): "llama2-13b", ("llama2", "70b"): "llama2-70b",
}
# torchtitan 0.3.0 MoE models with a plan3d preset: models/deepseek_v3/__init__.py "671B" (no MTP layers unless
# asked), models/qwen3/__init__.py "30B-A3B"; and their config-registry functions (planner/emit/torchtitan.py).
MOE_PRESETS = {("deepseek_v3", "671b"): "deepseek-v3", ("qwen3", "30b-a3b"): "qwen3-30b-a3b"}
REGISTRY_CONFIGS = {"deepseek_v3_671b": ("deepseek_v3", "671b"), "deepseek_v3_671b_float8": ("deepseek_v3", "671b"),
                    "qwen3_30b_a3b": ("qwen3", "30b-a3b"), "llama3_8b_mxfp8": ("llama3", "8b")}
FP8_CONFIGS = ("deepseek_v3_671b_float8",)  # its registry function converts linears and experts to float8
#: registry functions that convert the linears to MXFP8 (models/llama3/config_registry.py llama3_8b_mxfp8:
#: MXFP8LinearConverter, torchao's MX linears; Blackwell only)
MXFP8_CONFIGS = ("llama3_8b_mxfp8",)
LLAMA31_MAX_SEQ_LEN = 131072  # torchtitan llama3 RoPE config max_seq_len (Llama 3.1 context)
MOE_MODELS = ("deepseek", "llama4", "moe", "gpt_oss", "kimi", "mixtral")
# torchao float8 model converters as torchtitan registers them: "float8" (Float8Converter, 2024-25 TOMLs), then
# "quantize.linear.float8" and "quantize.grouped_mm.float8" (components/quantization/float8.py,
# register_model_converter)
FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8", "quantize.grouped_mm.float8")
# torchao's MX converters likewise (components/quantization/mx.py): "mx" (MXConverter, 2025, options in [mx]), then
# "quantize.linear.mx" (MXLinearConverter, options in [quantize.linear.mx]) and "quantize.grouped_mm.mx"
# (MXGroupedMMConverter, the experts' grouped GEMMs, [quantize.grouped_mm.mx]); each takes a torchao
# ``recipe_name`` (MXLinearConfig.from_recipe_name: "mxfp8_cublas" by default, also "mxfp8_emulated",
# "mxfp8_cublas_rceil", "mxfp4_emulated", "mxfp4_cutlass"; the grouped GEMMs' "mxfp8", "mxfp8_rceil")
MX_CONVERTERS = ("mx", "quantize.linear.mx", "quantize.grouped_mm.mx")
# the converters of the linears, by family: the first two of each tuple above
LINEAR_CONVERTERS = {"fp8": FLOAT8_CONVERTERS[:2], "mxfp8": MX_CONVERTERS[:2]}
# ActivationCheckpoint.mode: "selective", "full", "none", and torch.compile's "memory_budget" (job_config.py)
AC_MODES = ("selective", "full", "none", "memory_budget")


def read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read: {err.__class__.__name__}") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None


def is_torchtitan(doc: dict) -> bool:
    return isinstance(doc.get("model"), dict) and ("parallelism" in doc or "training" in doc) and \
        "name" in doc["model"]


def apply_overrides(doc: dict, words: list[str]) -> dict:
    """``--section.key value`` / ``--section.key=value`` / ``--section.flag`` (true) on top of the TOML;
    ``activation_checkpoint:MODE`` (torchtitan 0.3's subcommand form) sets the mode, whose selective is per-op."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    i = 0
    while i < len(words):
        word = words[i]
        m = re.fullmatch(r"activation_checkpoint:(\w+)", word)
        if m:  # torchtitan 0.3's SelectiveAC is per-op only (distributed/activation_checkpoint.py): no layer option
            out["activation_checkpoint"] = {"mode": m.group(1), "selective_ac_option": "op"}
        elif word.startswith("--") and "." in word:
            key, eq, value = word[2:].partition("=")
            if not eq:
                nxt = words[i + 1] if i + 1 < len(words) else None
                if nxt is not None and not nxt.startswith("--") and not re.fullmatch(r"\w+:\w+", nxt):
                    value, i = nxt, i + 1
                else:
                    value = "true"
            section, _, name = key.partition(".")
            value = _scalar(value)
            if name.startswith("no-") and value is True:  # tyro's negated flag: --compile.no-enable
                name, value = name[3:], False
            out.setdefault(section, {})[name.replace("-", "_")] = value
        elif word in ("--module", "--config") and i + 1 < len(words):
            out.setdefault("_registry", {})[word[2:]] = words[i + 1]
            i += 1
        i += 1
    return out


def _scalar(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        return value


def _model(doc: dict, where: str, notes: list[str]) -> dict:
    model = doc.get("model", {})
    registry = doc.get("_registry", {}).get("config", "")
    name = str(model.get("name", doc.get("_registry", {}).get("module", ""))).lower()
    flavor = str(model.get("flavor", "")).lower()
    if not flavor and registry:
        m = re.fullmatch(r"([a-z]+\d?)_(\d+b)", registry.lower())
        if registry.lower() in REGISTRY_CONFIGS:
            name, flavor = REGISTRY_CONFIGS[registry.lower()]
        elif m:
            name, flavor = m.group(1), m.group(2)
    moe = any(x in name for x in MOE_MODELS) or re.search(r"a\d+b", flavor)
    if moe and (name, flavor) not in MOE_PRESETS:
        raise SpecError(f"{where}: torchtitan model {name} {flavor} is a mixture-of-experts model with no plan3d preset "
                        f"(known: {', '.join(f'{n} {f.upper()}' for n, f in MOE_PRESETS)}); refused rather than read "
                        "as another model")
    preset = PRESETS.get((name, flavor)) or MOE_PRESETS.get((name, flavor))
    if preset is None:
        raise SpecError(f"{where}: torchtitan model {name} flavor {flavor or registry or '?'} has no plan3d preset "
                        f"(known: {', '.join(f'{n} {f.upper()}' for n, f in PRESETS)})")
    spec = load_model(preset).model_dump()
    if name == "llama3":
        spec["max_seq_len"] = LLAMA31_MAX_SEQ_LEN
    if spec.get("mtp_num_layers"):  # the flavours read here build no MTP layers (models/deepseek_v3/__init__.py)
        spec["mtp_num_layers"] = 0
        notes.append(f"model: torchtitan {name} {flavor.upper()} builds no multi-token-prediction layer; "
                     "read with mtp_num_layers 0")
    notes.append(f"model: torchtitan {name} {flavor.upper()} = plan3d preset {preset}")
    return spec


def scenario_dicts(doc: dict, gpus: int | None, where: str) -> tuple[dict, dict, dict, list[str]]:
    notes: list[str] = []
    model = _model(doc, where, notes)
    par, tr = doc.get("parallelism", {}), doc.get("training", {})
    get = lambda key, default: par.get(key, tr.get(key, default))  # noqa: E731 (2024 TOMLs kept degrees in [training])
    num = lambda key, value: _int(value, key, where)  # noqa: E731
    rep = num("data_parallel_replicate_degree", get("data_parallel_replicate_degree", 1))
    shard = num("data_parallel_shard_degree", get("data_parallel_shard_degree", -1))
    tp, pp, cp = (num(k, get(k, 1)) for k in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                              "context_parallel_degree"))
    for key, value in (("data_parallel_replicate_degree", rep), ("tensor_parallel_degree", tp),
                       ("pipeline_parallel_degree", pp), ("context_parallel_degree", cp)):
        if value < 1:
            raise SpecError(f"{where}: parallelism.{key} = {value}: must be at least 1")
    if shard == 0 or shard < -1:
        raise SpecError(f"{where}: parallelism.data_parallel_shard_degree = {shard}: at least 1, or -1 for the rest")
    fixed = rep * tp * pp * cp
    if shard == -1:
        if gpus is None:
            raise SpecError(f"{where}: data_parallel_shard_degree = -1 takes the ranks left over and no launcher gives "
                            "the GPU count; pass --gpus")
        if gpus % fixed:
            raise SpecError(f"{where}: {gpus} GPUs are not divisible by replicate({rep}) * tp({tp}) * pp({pp}) * "
                            f"cp({cp}) = {fixed}")
        shard = gpus // fixed
    world = fixed * shard
    if gpus is not None and gpus != world:
        raise SpecError(f"{where}: the degrees multiply to {world} GPUs, not the {gpus} the launcher (or --gpus) gives")
    if rep > 1 and shard > 1:
        raise SpecError(f"{where}: HSDP (data_parallel_replicate_degree {rep} x shard {shard}) is not modelled "
                        "(plan3d shards over all data-parallel ranks)")
    dp = rep * shard
    local = num("local_batch_size", tr.get("local_batch_size", tr.get("batch_size", 8)))
    gbs = num("global_batch_size", tr.get("global_batch_size", -1))
    if local < 1:
        raise SpecError(f"{where}: training.local_batch_size = {local}: must be at least 1")
    gbs = local * dp if gbs <= 0 else gbs
    if gbs % (local * dp):
        raise SpecError(f"{where}: global_batch_size {gbs} is not a multiple of local_batch_size({local}) * dp({dp})")
    mbs = num("pipeline_parallel_microbatch_size", par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    schedule = str(par.get("pipeline_parallel_schedule", "1F1B"))
    vpp = 1
    pipeline_schedule = None
    if pp > 1:
        # torch get_schedule_class matches the names case-insensitively (schedules.TORCHTITAN_SCHEDULE_NAMES)
        known = {name.lower(): ours for ours, name in TORCHTITAN_SCHEDULE_NAMES.items()}
        if schedule.lower() not in known:
            raise SpecError(f"{where}: pipeline_parallel_schedule {schedule} is not modelled; plan3d models "
                            f"{', '.join(TORCHTITAN_SCHEDULE_NAMES.values())} (docs/schedules.md)")
        ours = known[schedule.lower()]
        pipeline_schedule = ours if ours in ("interleaved_zb", "zbv", "dualpipev") else None
        if ours in ("zbv", "dualpipev"):
            vpp = 2  # torch: exactly 2 stages per rank, in a V
        elif ours in ("interleaved", "interleaved_zb"):
            per_stage = par.get("pipeline_parallel_layers_per_stage")
            per_stage = num("pipeline_parallel_layers_per_stage", per_stage) if per_stage else None
            if per_stage is not None and per_stage < 1:
                raise SpecError(f"{where}: pipeline_parallel_layers_per_stage = {per_stage}: must be at least 1")
            vpp = max(1, model["num_layers"] // (pp * per_stage)) if per_stage else 2
    if pp > 1 and par.get("pipeline_parallel_schedule_csv"):
        raise SpecError(f"{where}: parallelism.pipeline_parallel_schedule_csv: a schedule read from a CSV file "
                        "(torch's _PipelineScheduleRuntime) is not modelled; plan3d models the named schedules "
                        "(docs/schedules.md)")
    # 1F1B is torch's only single-stage schedule plan3d reads; the others run 2 stages per rank by default
    layers_per_stage = _explicit_split(par, model["num_layers"], pp, where, num, pipeline_schedule,
                                       multi_stage=schedule.lower() != "1f1b",
                                       defaults=bool(doc.get("_registry"))) if pp > 1 else None
    manual = _manual_split(par, model["num_layers"], pp, where, pipeline_schedule) if pp > 1 else None
    if manual is not None:  # the config's own stages win over torchtitan's automatic split
        layers_per_stage = manual
        notes.append(f"pipeline split as the config names its stages: {manual[0]} layers per rank, "
                     f"{manual[1]} stages per rank")
    if layers_per_stage is not None:
        layers_per_stage, vpp = layers_per_stage
        if pipeline_schedule in ("zbv", "dualpipev") and len(set(layers_per_stage)) == 1:
            layers_per_stage = None  # an even V layout, as Plan wants it
    # JobConfig defaults: mode "selective", selective_ac_option "2" (every second layer fully checkpointed)
    # (older torchtitan, TOML configs: ActivationCheckpoint in config/job_config.py; 0.3.0 has per-op SAC only)
    ac = doc.get("activation_checkpoint", {})
    mode = str(ac.get("mode", "selective"))
    interval = None
    if mode not in AC_MODES:
        raise SpecError(f"{where}: activation_checkpoint.mode = {mode!r}: torchtitan takes {', '.join(AC_MODES)}")
    if mode == "memory_budget":
        notes.append("activation_checkpoint memory_budget (torch.compile's min-cut under a budget): modelled as no "
                     "recompute, an upper bound")
    if mode == "selective":
        option = str(ac.get("selective_ac_option", "2")).strip()
        if option == "op":
            notes.append("activation_checkpoint selective (op): modelled as selective recompute")
        elif option.isdigit():  # _apply_layer_sac: every N-th block a rank builds, all of them for 0 or 1
            mode = "full"
            interval = int(option) if int(option) > 1 else None
            if interval is not None:
                notes.append(f"activation_checkpoint selective every {interval} layers: one layer in every {interval} "
                             "of a rank fully recomputed, the others keep everything")
        else:
            raise SpecError(f"{where}: activation_checkpoint.selective_ac_option = {option!r}: torchtitan takes 'op' "
                            "or a layer frequency such as '2'")
    family = _converter_family(doc, tp, where, notes)
    registry_config = str(doc.get("_registry", {}).get("config", "")).lower()
    fp8 = family == "fp8" or bool(doc.get("float8", {}).get("enable_float8_linear")) or registry_config in FP8_CONFIGS
    mxfp8 = family == "mxfp8" or registry_config in MXFP8_CONFIGS
    if fp8 and mxfp8:
        raise SpecError(f"{where}: float8 and MX linears together (model.converters and float8.enable_float8_linear) "
                        "are not modelled; keep one")
    if fp8 and (_flag(doc.get("float8", {}), "float8", "enable_fsdp_float8_all_gather", where) or
                _flag(_options(doc, "quantize.linear.float8"), "quantize.linear.float8", "enable_fsdp_float8_all_gather",
                      where)):
        # torchao's WeightWithDynamicFloat8CastTensor (2024-25 TOMLs; gone from torchtitan 0.3.0's float8 converter)
        notes.append("float8.enable_fsdp_float8_all_gather: FSDP all-gathers the weights in float8 (1 B, not 2); "
                     "plan3d gathers and holds them in bf16, an over-estimate of the gathered weights' memory and of "
                     "the all-gather and copy-out time")
    # [training] in 2024 TOMLs, [parallelism] since
    lp_name, lp_section = ("parallelism", par) if "disable_loss_parallel" in par else ("training", tr)
    if _flag(lp_section, lp_name, "disable_loss_parallel", where):
        if tp > 1:  # parallelize.py: the output layer then gathers the whole vocabulary on every TP rank
            raise SpecError(f"{where}: parallelism.disable_loss_parallel with tp {tp}: every TP rank then holds the "
                            "whole vocabulary's logits and loss, which plan3d does not model (it counts loss_parallel's "
                            "V / tp); drop it")
        notes.append("parallelism.disable_loss_parallel: no effect without tensor parallelism")
    if _flag(tr, "training", "enable_cpu_offload", where):
        notes.append("training.enable_cpu_offload (FSDP2 CPUOffloadPolicy): the parameters, gradients and optimizer "
                     "states counted in GPU memory, an upper bound")
    ep = num("expert_parallel_degree", par.get("expert_parallel_degree", 1))
    if ep < 1:
        raise SpecError(f"{where}: parallelism.expert_parallel_degree = {ep}: must be at least 1")
    if ep > 1 and model.get("num_experts") is None:
        ep = 1  # ParallelismConfig: "No effect for non-MoE models"
        notes.append("expert_parallel_degree on a dense model: torchtitan ignores it")
    if (shard * cp * tp) % ep:
        raise SpecError(f"{where}: expert_parallel_degree {ep} does not divide data_parallel_shard_degree({shard}) x "
                        f"cp({cp}) x tp({tp}) = {shard * cp * tp}, the ranks torchtitan draws EP from")
    backend = str(par.get("expert_parallel_comm_backend", "standard"))
    if ep > 1 and backend != "standard":
        # torchtitan's ParallelismConfig.expert_parallel_comm_backend ("standard": torch's all-to-all; "deepep" and,
        # later, "hybridep": DeepEP's own buffers, torchtitan/distributed/deepep), "no effect ... when ep = 1". plan3d
        # sizes DeepEP's and HybridEP's buffers as Megatron-Core builds them, not as torchtitan does: read as the
        # all-to-all it would leave them out, a false "fits"
        raise SpecError(f"{where}: parallelism.expert_parallel_comm_backend = {backend}: torchtitan's DeepEP/HybridEP "
                        "buffers are not modelled (plan3d would count the all-to-all's memory and under-count them); "
                        "check the job with 'standard', or as a Megatron-LM launch with the flex dispatcher")
    zero = _fsdp_zero_stage(par, shard, pp, where, notes, cp)
    compiled = _compile(doc, tr, notes, where)
    training = {"num_gpus": world, "global_batch_size": gbs, "seq_len": num("seq_len", tr.get("seq_len", 2048)),
                "precision": _precision(tr, fp8, where, notes, mxfp8), "attention": "flash", "framework": "torchtitan",
                **compiled, **_async_tp(doc, tp, compiled, where)}
    plan = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "vpp": vpp, "micro_batch_size": mbs,
            "recompute": {"full": "full", "selective": "selective"}.get(mode, "none"), "recompute_interval": interval,
            "sequence_parallel": tp > 1 and bool(par.get("enable_sequence_parallel", True)),
            "zero_stage": zero, "layers_per_stage": layers_per_stage,
            # the sparse mesh (pp, dp_replicate, efsdp, ep) has no tensor axis: experts are whole with ep > 1,
            # split over tp without EP (models/common/moe_sharding.py)
            "ep": ep, "etp": 1 if ep > 1 and tp > 1 else None}
    if pipeline_schedule is not None:
        plan["pipeline_schedule"] = pipeline_schedule
    # torchtitan's whole-step CUDA graph (pytorch/torchtitan#3559): absent from TOML-era torchtitan (before its
    # config registry); else on unless --training.disable_cuda_graphs (TrainingSpec.step_cuda_graph, None: the default)
    disable = _flag(tr, "training", "disable_cuda_graphs", where)
    if not doc.get("_registry") or disable:
        training["step_cuda_graph"] = False
    elif step_cuda_graph_by_default(pp, ep):
        notes.append("CUDA graph of each forward+backward (torchtitan's default; --training.disable_cuda_graphs turns "
                     "it off): the gradient shards are zeroed, not freed, so the allocated figure holds them through "
                     "the forward; the graph's private memory pool is taken as the eager peak")
    if pp > 1 and not doc.get("_registry"):
        # a TOML config is torchtitan from before its config registry (0.3.0, whose trainer calls
        # step(..., return_outputs=False)); its schedules kept the stage outputs: every stage's on torch before
        # pytorch#153383, the last stage's after it. Read as the first, an upper bound on the second
        # (planner.memory.pipeline_kept_output_bytes)
        training["pipeline_kept_outputs"] = "all"
        notes.append("pipeline (TOML-era torchtitan): the schedule keeps every stage's outputs until the step ends "
                     "(torch before return_outputs=False), modelled as pipeline_kept_outputs all")
    return model, training, plan, notes


def _options(doc: dict, dotted: str) -> dict:
    """A JobConfig section by its dotted name, as the TOML nests it (``[quantize.linear.mx]``: ``doc["quantize"]
    ["linear"]["mx"]``) with the command line's ``--quantize.linear.mx.recipe_name`` overrides (kept flat by
    :func:`apply_overrides` under the first part, ``doc["quantize"]["linear.mx.recipe_name"]``) on top."""
    head, _, rest = dotted.partition(".")
    section = doc.get(head, {})
    nested = section
    for part in rest.split(".") if rest else ():
        nested = nested.get(part, {}) if isinstance(nested, dict) else {}
    out = dict(nested) if isinstance(nested, dict) else {}
    if rest and isinstance(section, dict):
        out |= {k[len(rest) + 1:]: v for k, v in section.items() if k.startswith(rest + ".")}
    return out


def _converter_family(doc: dict, tp: int, where: str, notes: list[str]) -> str | None:
    """The low precision ``[model] converters`` give the linears: "fp8" (torchao's float8, ``FLOAT8_CONVERTERS``),
    "mxfp8" (torchao's MX with an MXFP8 recipe, ``MX_CONVERTERS``) or None. A list is a TOML array or, on the
    command line, comma-separated (the TOML-era JobConfig's ``string_list``). Refused, with the reason: a converter
    of neither family, the two families together, a grouped-GEMM converter without its linear one (low-precision
    experts, 16-bit linears elsewhere: not modelled), an MX recipe other than MXFP8's (MXFP4, or torchao's
    emulation, which runs the GEMMs in high precision), and the "mx" converter with tensor parallelism under a
    compiled model, which torchtitan's ``MXConverter`` itself refuses ("TP not yet supported with torch.compile for
    mxfp8")."""
    converters = doc.get("model", {}).get("converters", [])
    converters = converters.split(",") if isinstance(converters, str) else list(converters)
    converters = [str(c).strip() for c in converters if str(c).strip()]
    unknown = [c for c in converters if c not in FLOAT8_CONVERTERS + MX_CONVERTERS]
    if unknown:
        raise SpecError(f"{where}: model.converters {unknown[0]!r} is not modelled (plan3d models torchao's float8 "
                        f"and MXFP8 linears: {', '.join(FLOAT8_CONVERTERS[:2] + MX_CONVERTERS[:2])}); drop it or use "
                        "one of those")
    if not converters:
        return None
    families = {"fp8" if c in FLOAT8_CONVERTERS else "mxfp8" for c in converters}
    if len(families) > 1:
        raise SpecError(f"{where}: model.converters mixes float8 and MX converters ({', '.join(converters)}): "
                        "not modelled; keep one family")
    (family,) = families
    if not any(c in LINEAR_CONVERTERS[family] for c in converters):
        raise SpecError(f"{where}: model.converters {converters[0]!r} alone (low-precision experts, 16-bit linears "
                        f"elsewhere) is not modelled; add {LINEAR_CONVERTERS[family][-1]} or drop it")
    if family == "mxfp8":
        for name in [c for c in converters if c in MX_CONVERTERS]:
            options = _options(doc, name)
            recipe = str(options.get("recipe_name", "mxfp8_cublas" if name != MX_CONVERTERS[2] else "mxfp8"))
            if not recipe.startswith("mxfp8") or "emulated" in recipe:
                raise SpecError(f"{where}: {name}.recipe_name = {recipe!r} is not modelled (plan3d models MXFP8 on "
                                "the tensor cores: mxfp8_cublas, mxfp8_cublas_rceil, mxfp8_rceil); use one of those")
            skipped = options.get("filter_fqns", ["output"]) if name != MX_CONVERTERS[2] else []
            skipped = skipped.split(",") if isinstance(skipped, str) else list(skipped)
            if any(str(f).strip() not in ("", "output") for f in skipped):
                notes.append(f"{name}.filter_fqns {', '.join(map(str, skipped))}: plan3d counts every linear but the "
                             "output layer in MXFP8")
        compiled = _options(doc, "compile")
        if "mx" in converters and tp > 1 and compiled.get("enable") is True and \
                "model" in str(compiled.get("components", "model,loss")):
            raise SpecError(f"{where}: the mx converter with tensor_parallel_degree {tp} and a compiled model: torchtitan "
                            "refuses it ('TP not yet supported with torch.compile for mxfp8'); drop one")
    return family


def _flag(section: dict, name: str, key: str, where: str) -> bool:
    """The boolean JobConfig field ``name.key`` of ``section`` (absent: False); anything but true/false is refused,
    as torchtitan's config parser refuses it."""
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(f"{where}: {name}.{key} = {value!r}: torchtitan takes true or false")
    return value


# JobConfig ``parallelism.fsdp_reshard_after_forward`` (default "default") and ``training.mixed_precision_param``
# (default "bfloat16"): torchtitan's Literal choices
RESHARD_POLICIES = ("default", "always", "never")
PARAM_DTYPES = ("bfloat16", "float32")


def _fsdp_zero_stage(par: dict, shard: int, pp: int, where: str, notes: list[str], cp: int = 1) -> int:
    """plan3d's ZeRO stage of a torchtitan job: none without FSDP (``data_parallel_shard_degree`` 1 and no context
    parallelism: ``ParallelDims.fsdp_enabled`` is ``dp_shard > 1 or cp > 1``, the parameters sharded over the
    dp_shard x cp mesh); with it, by
    ``fsdp_reshard_after_forward`` as ``parallelize.py::apply_fsdp`` applies it: "default" reshards after forward
    unless PP, "always" does, "never" keeps every block's gathered parameters from its forward to its backward, which
    is plan3d's ZeRO 2 under this framework (planner/frameworks/torchtitan.py ``reshard_after_forward``; ``plan3d emit
    torchtitan`` writes "never" for it). Read as ZeRO 3 before, a launch emitted with "never" was judged without the
    gathered parameters it holds."""
    policy = str(par.get("fsdp_reshard_after_forward", "default"))
    if policy not in RESHARD_POLICIES:
        raise SpecError(f"{where}: parallelism.fsdp_reshard_after_forward = {policy!r}: torchtitan takes "
                        f"{', '.join(RESHARD_POLICIES)}")
    if shard == 1 and cp == 1:
        return 0
    if policy == "never":
        notes.append("FSDP2 with fsdp_reshard_after_forward never: each block keeps its gathered parameters from "
                     "forward to backward, modelled as ZeRO-2")
        return 2
    notes.append("FSDP2 (over data_parallel_shard_degree x context_parallel_degree): modelled as ZeRO-3")
    if policy == "always" and pp > 1:
        notes.append("fsdp_reshard_after_forward always with PP: the stage's gathered parameters are counted as "
                     "kept (torchtitan's default under PP), more than this job holds")
    return 3


def _precision(tr: dict, fp8: bool, where: str, notes: list[str], mxfp8: bool = False) -> str:
    """bf16, fp8 with torchao's Float8 converter, mxfp8 with a registry function's MXFP8 converter
    (``MXFP8_CONFIGS``); ``mixed_precision_param = "float32"`` keeps the parameters, and so
    the compute and the saved activations, in fp32 (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, and no
    autocast without FSDP: torchtitan ``distributed/utils.py`` ``maybe_enable_amp``): plan3d's fp32 training."""
    param = str(tr.get("mixed_precision_param", "bfloat16"))
    reduce = str(tr.get("mixed_precision_reduce", "float32"))
    if reduce != "float32":  # 0.3.0 config/configs.py: mixed_precision_reduce: Literal["float32"]
        raise SpecError(f"{where}: training.mixed_precision_reduce = {reduce!r}: torchtitan takes float32 only")
    if param not in PARAM_DTYPES:
        raise SpecError(f"{where}: training.mixed_precision_param = {param!r}: torchtitan takes "
                        f"{', '.join(PARAM_DTYPES)}")
    if param == "float32":
        if fp8 or mxfp8:
            raise SpecError(f"{where}: training.mixed_precision_param float32 with Float8 linears is not modelled "
                            "(plan3d's fp8 keeps 16-bit parameters); use bfloat16 or drop the float8 converter")
        notes.append("training.mixed_precision_param float32: parameters, compute and activations in fp32, "
                     "modelled as fp32 training")
        return "fp32"
    return "mxfp8" if mxfp8 else "fp8" if fp8 else "bf16"


# torchtitan 0.3.0 config-registry functions that enable compile (planner/emit/torchtitan.py compile_args)
REGISTRY_COMPILE = {"llama3_405b": ("model", "loss"), "deepseek_v3_671b": ("loss",), "deepseek_v3_671b_float8": ("loss",),
                    "llama3_8b_mxfp8": ("model",)}


def _compile(doc: dict, tr: dict, notes: list[str], where: str) -> dict:
    """``compile`` / ``compile_components`` of the training spec: ``[compile] enable`` and ``components`` (0.3.0
    ``CompileConfig``: enable False, components ["model", "loss"]; a list, or comma-separated on the command
    line), else the ``--config`` function's own setting, else ``[training] compile`` (2024 JobConfig), which
    torchtitan 9dec370 applied to the blocks only (docs/memory.md "torch.compile (torchtitan)")."""
    sec = doc.get("compile", {})
    registry = REGISTRY_COMPILE.get(str(doc.get("_registry", {}).get("config", "")).lower())
    backend = str(sec.get("backend", "inductor"))
    if backend != "inductor" and (sec.get("enable", registry is not None) or tr.get("compile")):
        # CompileConfig.backend (0.3.0 distributed/compile.py hands it to torch.compile): plan3d models inductor's
        # min-cut partition (what it saves and recomputes, docs/memory.md "torch.compile (torchtitan)")
        raise SpecError(f"{where}: compile.backend = {backend!r} is not modelled: plan3d sizes a compiled torchtitan "
                        "model as inductor partitions it, and another backend saves other tensors; use inductor or "
                        "turn compile off")
    if "enable" in sec or "components" in sec:
        comps = sec.get("components", registry or ("model", "loss"))
        comps = comps.split(",") if isinstance(comps, str) else comps
        comps = tuple(c.strip() for c in comps if c.strip() in ("model", "loss"))
        return {"compile": bool(sec.get("enable", registry is not None)), "compile_components": comps}
    if registry is not None:
        return {"compile": True, "compile_components": registry}
    if tr.get("compile"):
        notes.append("training.compile (2024 JobConfig): modelled as the blocks compiled, the loss eager (torchtitan "
                     "9dec370)")
        return {"compile": True, "compile_components": ("model",)}
    return {}


def _async_tp(doc: dict, tp: int, compiled: dict, where: str) -> dict:
    """``tp_comm_overlap`` of the training spec: torchtitan's async TP, from ``[compile] enable_async_tensor_parallel``
    (0.3.0 ``CompileConfig``), ``[parallelism]`` (2025 JobConfig) or ``[experimental]`` (2024 TOMLs, the torchtitan
    paper's AsyncTP runs), else the ``--config`` function's own setting; it applies only with a TP mesh
    (``distributed/compile.py``: "if not compile_config.enable_async_tensor_parallel or tp_mesh is None: return").
    Async TP without the blocks compiled is refused, as torchtitan refuses it at startup."""
    registry = str(doc.get("_registry", {}).get("config", "")).lower()
    on = registry in ASYNC_TP_CONFIGS
    for section in ("experimental", "parallelism", "compile"):  # the newest layout last: it wins
        if doc.get(section, {}).get("enable_async_tensor_parallel") is None:
            continue
        on = _flag(doc[section], section, "enable_async_tensor_parallel", where)
    if not on or tp <= 1:
        return {}
    if not (compiled.get("compile") and "model" in compiled.get("compile_components", ())):
        raise SpecError(f"{where}: enable_async_tensor_parallel without the blocks compiled: torchtitan refuses it "
                        "(\"Async TP requires 'model' in --compile.components and --compile.enable\"); compile the "
                        "model or turn async TP off")
    return {"tp_comm_overlap": True}


def _ranks_of_stages(split: list[int], pp: int, schedule: str | None) -> list[int]:
    """Layers of each pipeline rank from the layers of each global stage: looped placement (stage ``c x pp + r`` on rank
    ``r``), or V placement for zbv/dualpipev (stages ``r`` and ``2 pp - 1 - r``; ``schedules.stage_index``)."""
    from planner.schedules import stage_index

    chunks = len(split) // pp
    return [sum(split[stage_index(schedule or "interleaved", pp, r, c)] for c in range(chunks)) for r in range(pp)]


def _manual_split(par: dict, num_layers: int, pp: int, where: str, schedule: str | None):
    """(layers per pipeline rank, vpp) where the config names each stage's modules itself: ``module_fqns_per_model_part``
    (torchtitan 0.3.0 ``ParallelismConfig``: one list of module names per stage; its ``layers.N`` entries are the
    stage's transformer layers) or ``pipeline_parallel_split_points`` (2025 TOMLs: the first module of every stage
    after the first, ``layers.N``); None without either. A split that does not cover the layers once each, or whose
    stage count is not a multiple of pp, is refused (torchtitan refuses it too)."""
    parts, points = par.get("module_fqns_per_model_part"), par.get("pipeline_parallel_split_points")
    if not parts and not points:
        return None
    layer = re.compile(r"layers\.(\d+)$")
    if parts:
        if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
            raise SpecError(f"{where}: parallelism.module_fqns_per_model_part: a list of lists of module names")
        found = [[int(m.group(1)) for m in (layer.match(str(f)) for f in part) if m] for part in parts]
        if sorted(i for f in found for i in f) != list(range(num_layers)):
            raise SpecError(f"{where}: parallelism.module_fqns_per_model_part does not name layers.0 to "
                            f"layers.{num_layers - 1} once each")
        split = [len(f) for f in found]
    else:
        if not isinstance(points, list):
            raise SpecError(f"{where}: parallelism.pipeline_parallel_split_points: a list of module names")
        starts = [layer.match(str(x)) for x in points]
        if not all(starts):
            raise SpecError(f"{where}: parallelism.pipeline_parallel_split_points: {points!r}: plan3d reads split "
                            "points of the form layers.N only")
        bounds = [0, *(int(m.group(1)) for m in starts), num_layers]
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise SpecError(f"{where}: parallelism.pipeline_parallel_split_points: {points!r} are not increasing "
                            f"layer indices below {num_layers}")
        split = [b - a for a, b in zip(bounds, bounds[1:])]
    if len(split) % pp or (schedule in ("zbv", "dualpipev") and len(split) != 2 * pp):
        raise SpecError(f"{where}: {len(split)} pipeline stages named for pp {pp}: torchtitan needs a multiple of pp "
                        "(two per rank for the V schedules)")
    return _modelled_split(split, pp, schedule, where, "the pipeline stages the config names")


def _modelled_split(split: list[int], pp: int, schedule: str | None, where: str, what: str) -> tuple[list[int], int]:
    """(layers per pipeline rank, vpp) of torchtitan's virtual stages ``split``, refused with the reason where the
    torchtitan profile does not model that split (``FrameworkProfile.plan_problems``: the splits torchtitan's own
    pipeline keys build, ``planner.frameworks.torchtitan.builds_split``), rather than read as another split."""
    from planner.frameworks import get as framework_profile
    from planner.schedules import stage_index
    from planner.specs import Plan, chunk_split

    ranks, vpp = _ranks_of_stages(split, pp, schedule), len(split) // pp
    chunks = chunk_split(ranks, vpp)  # the chunks a Plan of these per-rank layers models (Plan.chunk_layers)
    modelled = [chunks[r][c] for r in range(pp) for c in range(vpp)]
    placed = [split[stage_index(schedule or "interleaved", pp, r, c)] for r in range(pp) for c in range(vpp)]
    probe = Plan.model_construct(tp=1, pp=pp, dp=1, cp=1, vpp=vpp, micro_batch_size=1, layers_per_stage=tuple(ranks),
                                 pipeline_schedule=schedule, ep=1, etp=None, zero_stage=3)
    if modelled != placed or any(line.startswith("layers_per_stage:")
                                 for line in framework_profile("torchtitan").plan_problems(probe)):
        raise SpecError(f"{where}: {what} ({split} layers per virtual stage, {ranks} per rank) are a split plan3d's "
                        "torchtitan profile does not model (those its first/last_stage_less_layers and "
                        "layers_per_stage keys build); refused rather than read as another split: name "
                        "pipeline_parallel_first/last_stage_less_layers so that torchtitan builds one it models "
                        "(plan3d emit torchtitan writes them)")
    return ranks, vpp


def _explicit_split(par: dict, num_layers: int, pp: int, where: str, num, schedule: str | None = None,
                    multi_stage: bool = False, defaults: bool = False):
    """(layers per pipeline rank, vpp) when the job names ``pipeline_parallel_first_stage_less_layers`` or
    ``..._last_stage_less_layers`` (as `plan3d emit` writes them): torchtitan 0.3.0's own split
    (``pipeline_parallel.py::_get_pipeline_metadata``: ``ceil((L + first + last) / layers_per_stage)`` virtual
    stages, or 2 per rank for a multi-stage schedule without layers_per_stage; placed as the schedule places them,
    :func:`_ranks_of_stages`; ``_generate_llm_fqn_per_model_part``, mirrored by
    ``planner.frameworks.torchtitan.split_layers``). ``defaults``: the job is torchtitan 0.3.0's (a config-registry
    command line), which applies the keys' defaults (1 and 1) when they are absent; a TOML-era job without them gets
    None (the even split is assumed, as the TOML releases split)."""
    keys = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")
    if not any(k in par for k in keys) and not defaults:
        return None
    import math

    from planner.frameworks.torchtitan import split_layers

    first, last = (num(k, par.get(k, 1)) for k in keys)  # ParallelismConfig defaults: 1 and 1
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    per_stage = num("pipeline_parallel_layers_per_stage", per_stage) if per_stage is not None else None
    if first < 0 or last < 0 or (per_stage is not None and per_stage < 1):
        raise SpecError(f"{where}: pipeline_parallel_*_less_layers must be >= 0 and layers_per_stage >= 1")
    # without layers_per_stage: pp x 2 virtual stages for a multi-stage schedule, pp for a single-stage one (0.3.0
    # _get_pipeline_metadata, "For multi-stage schedules, default is 2 virtual stages per rank")
    stages = math.ceil((num_layers + first + last) / per_stage) if per_stage else pp * (2 if multi_stage else 1)
    split = split_layers(stages, num_layers, first, last)
    if stages % pp or split is None:
        raise SpecError(f"{where}: torchtitan cannot split {num_layers} layers into {stages} virtual stages over "
                        f"pp {pp} with first/last stage {first}/{last} layers less")
    named = any(k in par for k in keys)
    return _modelled_split(split, pp, schedule, where, "torchtitan's split with first/last stage "
                           f"{first}/{last} layers less" + ("" if named else " (its defaults)"))


def _int(value, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(f"{where}: {key} = {value!r}: not an integer")
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{where}: {key} = {value!r}: not an integer") from None
