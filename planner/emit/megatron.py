"""Megatron-LM ``pretrain_gpt.py`` arguments for a plan: a pure mapping, then a launch script.

Flag names are Megatron-LM's own (``megatron/training/arguments.py``; the list plan3d relies on is
in tests/data/megatron_lm_arguments.txt with its source commit). Megatron's defaults differ from
Llama-style models (biases on, dropout 0.1, learned positions, LayerNorm, tied embeddings), so
every model-shape flag is written out explicitly.
"""

from __future__ import annotations

import re
import shlex

from planner.names import slug
from planner.presets import SpecError
from planner.memory import hybridep_domain_ranks
from planner.specs import FLEX_DISPATCHERS, Scenario, a2a_overlap_problems, chunk_split

Flag = tuple[str, "str | tuple[str, ...] | None"]  # a tuple: one flag with several values (argparse nargs)

# ZeRO stage -> Megatron flags: the distributed optimizer is ZeRO-1; Megatron FSDP shards more.
ZERO_FLAGS: dict[int, list[Flag]] = {
    0: [],
    1: [("--use-distributed-optimizer", None)],
    2: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads")],
    3: [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params")],
}


def model_flags(sc: Scenario) -> list[Flag]:
    m = sc.model
    flags: list[Flag] = [
        ("--num-layers", str(m.num_layers)), ("--hidden-size", str(m.hidden_size)),
        ("--ffn-hidden-size", str(m.ffn_size)), ("--num-attention-heads", str(m.num_attention_heads)),
        ("--kv-channels", str(m.kv_channels)),
    ]
    if m.kv_heads != m.num_attention_heads and not m.is_mla:  # validate_args: MLA excludes GQA
        flags += [("--group-query-attention", None), ("--num-query-groups", str(m.kv_heads))]
    # The emitted runs use Megatron's NullTokenizer (run_flags), which has --vocab-size + 1 tokens (the
    # end-of-document id: megatron/training/tokenizer/tokenizer.py _NullTokenizer.vocab_size), so V - 1
    # builds the model's V rows before padding.
    flags += [("--vocab-size", str(m.vocab_size - 1)), ("--make-vocab-size-divisible-by", "128"),
              ("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm")]
    # validate_args requires --max-position-embeddings (required_args) and at least --seq-length; a model with no
    # stated limit (a RoPE model whose config names none) gets the job's sequence length
    flags.append(("--max-position-embeddings", str(m.max_seq_len if m.max_seq_len is not None else sc.training.seq_len)))
    flags.append(("--position-embedding-type",
                  {"learned": "learned_absolute", "rope": "rope", "alibi": "none"}[m.position_embedding]))
    if m.rotary_percent != 1:  # arguments.py --rotary-percent (default 1.0): RoPE on that share of each head
        flags.append(("--rotary-percent", f"{m.rotary_percent:g}"))
    if m.activation == "swiglu":
        flags.append(("--swiglu", None))
    elif m.activation == "squared_relu":  # arguments.py --squared-relu: activation_func = squared_relu
        flags.append(("--squared-relu", None))
    if not m.tied_embeddings:
        flags.append(("--untie-embeddings-and-output-weights", None))
    if not m.all_linear_biases:  # --add-bias-linear is Megatron's default: biases on every linear layer
        flags.append(("--disable-bias-linear", None))
        if m.has_qkv_bias:
            flags.append(("--add-qkv-bias", None))
    dropout = "0.1" if m.dropout else "0.0"
    flags += [("--attention-dropout", dropout), ("--hidden-dropout", dropout)]
    if m.mtp_num_layers:  # TransformerConfig.mtp_num_layers: built on the last pipeline stage
        flags.append(("--mtp-num-layers", str(m.mtp_num_layers)))
    return flags + attention_flags(sc) + moe_flags(sc)


def attention_flags(sc: Scenario) -> list[Flag]:
    """Q/K norms, MLA and attention sinks as Megatron-LM core_v0.16.1 flags.

    * ``--qk-layernorm``: one ``normalization`` norm over each query and key head
      (``TransformerConfig.qk_layernorm``; ``gpt_layer_specs.py`` builds ``q_layernorm``/``k_layernorm``
      of ``hidden_size_per_attention_head``), the Qwen3 per-head Q/K RMSNorm (``qk_norm: head``).
    * MLA (``MLATransformerConfig``, ``--multi-latent-attention``): ``--q-lora-rank`` (absent: a full q
      projection, ``linear_q_proj``), ``--kv-lora-rank``, ``--qk-head-dim`` (the non-rotary part,
      DeepSeek ``qk_nope_head_dim``), ``--qk-pos-emb-head-dim`` (the rotary part, ``qk_rope_head_dim``),
      ``--v-head-dim``. ``--qk-layernorm`` builds the latent norms (DeepSeek ``q_a_layernorm`` and
      ``kv_a_layernorm``): with MLA, ``gpt_layer_specs.py`` makes ``linear_q_up_proj`` and
      ``linear_kv_up_proj`` layer-norm linears exactly when it is set.
    * Attention sinks (GPT-OSS ``sinks``): ``--softmax-type learnable``, one learned offset per head
      (``dot_product_attention.py``: ``softmax_offset`` of ``num_attention_heads_per_partition``).
    """
    m = sc.model
    flags: list[Flag] = []
    if m.is_mla:
        flags.append(("--multi-latent-attention", None))
        if m.q_lora_rank is not None:
            flags.append(("--q-lora-rank", str(m.q_lora_rank)))
        flags += [("--kv-lora-rank", str(m.kv_lora_rank)), ("--qk-head-dim", str(m.qk_nope_head_dim)),
                  ("--qk-pos-emb-head-dim", str(m.qk_rope_head_dim)), ("--v-head-dim", str(m.v_head_dim)),
                  ("--qk-layernorm", None)]
    elif m.qk_norm == "head":
        flags.append(("--qk-layernorm", None))
    if m.attention_sinks:
        flags.append(("--softmax-type", "learnable"))
    return flags


#: Megatron-LM's recommended starting value of the auxiliary load-balancing loss coefficient
#: (core_v0.16.1 ``arguments.py``, ``--moe-aux-loss-coeff`` help: "a starting value of 1e-2 is
#: recommended"); Megatron's default, 0.0, trains with no balancing at all. A plan3d model carries no
#: balancing coefficient (it changes no memory), so this is a stated choice, not the model's.
MOE_AUX_LOSS_COEFF = "1e-2"


def moe_layer_freq(num_layers: int, first_k_dense: int) -> str:
    """``--moe-layer-freq`` for ``first_k_dense`` dense layers then experts, in Megatron's pattern syntax
    (``arguments.py::moe_freq_type``: "([0]+[1]*23)": 1 dense layer followed by 23 expert layers)."""
    return f"([0]*{first_k_dense}+[1]*{num_layers - first_k_dense})"


def moe_layer_pattern_arg(pattern: tuple[int, ...]) -> str:
    """``--moe-layer-freq`` for any ``ModelSpec.moe_layer_pattern``, in the list syntax Megatron evaluates
    (``arguments.py::moe_freq_type``: digits, ',', '[]', '()', '+' and '*'): a repeated period of at most 8 layers as
    "([0,1]*24)", else its runs, "([0]*3+[1]*58)"."""
    n = len(pattern)
    for period in range(1, min(8, n - 1) + 1):
        if n % period == 0 and tuple(pattern[:period]) * (n // period) == tuple(pattern):
            return f"([{','.join(map(str, pattern[:period]))}]*{n // period})"
    runs: list[list[int]] = []
    for x in pattern:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{k}" for x, k in runs) + ")"


def moe_flags(sc: Scenario) -> list[Flag]:
    """A mixture-of-experts model as Megatron-LM core_v0.16.1 flags (``TransformerConfig`` MoE fields).

    ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size`` (written even when equal to the
    dense width), ``--moe-shared-expert-intermediate-size`` (+ ``--moe-shared-expert-gate``),
    ``--moe-layer-freq`` for dense layers (first or anywhere, ``moe_layer_pattern``); ``--moe-router-num-groups`` and
    ``--moe-router-group-topk`` for group-limited routing; ``--moe-grouped-gemm`` (TEGroupedMLP: the same
    parameters as one MLP per expert, fewer kernel launches; left out for a job with ``moe_grouped_gemm`` False,
    Megatron's SequentialMLP) and ``--moe-token-dispatcher-type
    alltoall`` (the dispatch the search prices by default; Megatron's own default, allgather, is written where a job
    asks for it, and priced as such: ``cost.moe_layer_extra``);
    ``--moe-router-dtype fp32`` for an fp32 router (absent: the parameters' dtype);
    ``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity`` for a capacity factor,
    so every expert's input is exactly its capacity (absent: dropless). ``--moe-router-pre-softmax``
    for top-1 routing (``TransformerConfig.__post_init__`` refuses top-1 softmax routing without it).
    ``--moe-shared-expert-overlap`` is not written: it reorders the shared expert after the router to
    overlap it with dispatch, a schedule choice plan3d's cost model does not price. The job's
    ``moe_token_dispatcher`` deepep is ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend
    deepep`` (``TransformerConfig``: "DeepEP backend is only supported with flex token dispatcher"), hybridep the same
    with ``--moe-flex-dispatcher-backend hybridep`` (and its NVLink-domain variables, :func:`env_lines`), allgather
    ``--moe-token-dispatcher-type allgather``, and ``moe_a2a_overlap`` is ``--overlap-moe-expert-parallel-comm``.
    """
    m = sc.model
    if not m.is_moe:
        return []
    flags: list[Flag] = [("--num-experts", str(m.num_experts)), ("--moe-router-topk", str(m.top_k)),
                         ("--moe-ffn-hidden-size", str(m.moe_ffn_size))]
    if m.first_k_dense:
        flags.append(("--moe-layer-freq", moe_layer_freq(m.num_layers, m.first_k_dense)))
    elif m.moe_layer_pattern is not None and not all(m.moe_layer_pattern):
        flags.append(("--moe-layer-freq", moe_layer_pattern_arg(m.moe_layer_pattern)))
    if m.router_num_groups is not None:  # group-limited routing (TransformerConfig.moe_router_num_groups)
        flags += [("--moe-router-num-groups", str(m.router_num_groups)),
                  ("--moe-router-group-topk", str(m.router_group_topk))]
    if m.shared_expert_ffn_hidden_size is not None:
        flags.append(("--moe-shared-expert-intermediate-size", str(m.shared_expert_ffn_hidden_size)))
        if m.shared_expert_gate:
            flags.append(("--moe-shared-expert-gate", None))
    if sc.training.moe_grouped_gemm:
        flags.append(("--moe-grouped-gemm", None))
    if sc.training.moe_token_dispatcher in FLEX_DISPATCHERS:  # transformer_config.py: DeepEP and HybridEP run under
        # the flex dispatcher
        flags += [("--moe-token-dispatcher-type", "flex"),
                  ("--moe-flex-dispatcher-backend", sc.training.moe_token_dispatcher)]
    else:  # alltoall, or the allgather a job asks for (written out, although Megatron's default)
        flags.append(("--moe-token-dispatcher-type", sc.training.moe_token_dispatcher))
    flags += [("--moe-router-load-balancing-type", "aux_loss"), ("--moe-aux-loss-coeff", MOE_AUX_LOSS_COEFF)]
    if sc.training.moe_a2a_overlap:
        flags.append(("--overlap-moe-expert-parallel-comm", None))
    if m.top_k == 1:
        flags.append(("--moe-router-pre-softmax", None))
    if m.router_dtype == "fp32":
        flags.append(("--moe-router-dtype", "fp32"))
    if m.capacity_factor is not None:
        flags += [("--moe-expert-capacity-factor", f"{m.capacity_factor:g}"),
                  ("--moe-pad-expert-input-to-capacity", None)]
    return flags


def moe_plan_refusals(sc: Scenario) -> list[str]:
    """What Megatron-LM core_v0.16.1 refuses in a MoE plan that plan3d's own rules let through, one line each.

    * ``moe_layer.py`` ``MoELayer.forward``: in training, tensor parallelism without sequence
      parallelism raises ("performance may degrade if MoE and tensor parallelism are enabled without
      also enabling sequence parallelism"); ``ModelParallelConfig`` only warns for ep > 1 with tp > 1.
    * ``transformer_config.py``: "Bias in Moe is only supported when ETP==1".
    """
    m, p = sc.model, sc.plan
    if not m.is_moe:
        return []
    errors = []
    if p.tp > 1 and not p.sequence_parallel:
        errors.append(f"--emit megatron: Megatron-LM's MoE layer refuses tp({p.tp}) > 1 without sequence parallelism "
                      "in training (core/transformer/moe/moe_layer.py); use a plan with sequence_parallel")
    if m.all_linear_biases and p.expert_tp > 1:
        errors.append(f"--emit megatron: Megatron-LM supports biases in MoE layers only with expert tensor parallelism "
                      f"1 (transformer_config.py), the plan has etp({p.expert_tp}); set etp 1")
    # TransformerConfig.__post_init__ (core_v0.16.1), overlap_moe_expert_parallel_comm's asserts
    errors += [f"--emit megatron: {line}" for line in a2a_overlap_problems(m, sc.training, p)]
    return errors


def is_even(sc: Scenario) -> bool:
    """True when every pipeline stage holds the same number of layers.

    Plan files always store ``layers_per_stage`` (``Scenario.resolved_plan``), so an explicit list equal
    to the even split is an even pipeline and gets no uneven-pipeline flags.
    """
    layers = sc.stage_layers
    return len(set(layers)) == 1


def layout_string(layers_per_stage: tuple[int, ...] | list[int], vpp: int, mtp: int = 0) -> str:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` for a plan's stages, written out in full.

    Source: Megatron-LM core_v0.16.1 ``megatron/core/transformer/pipeline_parallel_layer_layout.py``:
    the string lists the virtual stages separated by ``|``, virtual stage ``v * pp + r`` being chunk
    ``v`` of pipeline rank ``r``; ``E`` is the embedding, ``t`` one transformer layer, ``L`` the loss,
    which must come first and last, ``m`` a multi-token-prediction layer (``mtp``, ``ModelSpec.mtp_num_layers``),
    which ``validate_layer_layout`` wants counted there, after every decoder layer and in the last virtual stage
    of its rank: written just before the loss. A stage of ``n`` layers is split into ``vpp`` chunks as
    :func:`planner.specs.chunk_split` says (``n / vpp`` each when it divides, the shorter chunks next to
    the embedding and the loss otherwise). No ``*`` shorthand: the string holds no shell glob character.
    """
    pp = len(layers_per_stage)
    split = chunk_split(layers_per_stage, vpp)
    chunks = []
    for v in range(vpp):
        for r in range(pp):
            text = "t" * split[r][v]
            if v == 0 and r == 0:
                text = "E" + text
            if v == vpp - 1 and r == pp - 1:
                text += "m" * mtp + "L"
            chunks.append(text)
    return "|".join(chunks)


MAX_LAYOUT_CHARS = 100_000  # bounds what `plan3d check` unrolls from a file it is given


def layout_layers(layout: str, pp: int) -> tuple[tuple[int, ...], int]:
    """(layers per pipeline stage, vpp) of a ``--pipeline-model-parallel-layout`` string: the inverse of
    :func:`layout_string`, with Megatron's ``(...)*n`` and ``x*n`` shorthands unrolled as its
    ``PipelineParallelLayerLayout.parse_str_to_list`` does."""
    text = layout.replace(",", "")

    def unroll(m: re.Match) -> str:
        if len(m.group(2)) > 6 or len(m.group(1)) * int(m.group(2)) > MAX_LAYOUT_CHARS:
            raise SpecError(f"--pipeline-model-parallel-layout: '{m.group(0)[:40]}' repeats more than "
                            f"{MAX_LAYOUT_CHARS} characters; no model has that many layers")
        return m.group(1) * int(m.group(2))

    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, unroll, text)
        if len(text) > MAX_LAYOUT_CHARS:
            raise SpecError(f"--pipeline-model-parallel-layout: longer than {MAX_LAYOUT_CHARS} characters unrolled")
    chunks = text.split("|")
    if pp < 1 or len(chunks) % pp:
        raise SpecError(f"--pipeline-model-parallel-layout: {len(chunks)} virtual stages are not a multiple of "
                        f"--pipeline-model-parallel-size {pp}")
    vpp = len(chunks) // pp
    stages = tuple(sum(chunks[v * pp + r].count("t") for v in range(vpp)) for r in range(pp))
    return stages, vpp


def pipeline_flags(sc: Scenario) -> list[Flag]:
    """How the layers go onto pipeline stages, in the form Megatron-LM core_v0.16.1 accepts.

    ``validate_args`` (``megatron/training/arguments.py``) takes at most one of
    ``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank`` and
    ``--pipeline-model-parallel-layout``, and refuses ``--decoder-first/last-pipeline-num-layers``
    with the first ("please use --num-virtual-stages-per-pipeline-rank ..."). ``TransformerConfig``
    gives every middle stage the same count, so stages whose middle differs (20/15/25/20) are written
    as a layout, which expresses any assignment exactly.
    """
    p = sc.resolved_plan()
    if p.pp == 1:
        return []
    layers = p.layers_per_stage
    vpp_flag: list[Flag] = [("--num-virtual-stages-per-pipeline-rank", str(p.vpp))] if p.vpp > 1 else []
    if p.microbatch_group_size is not None:
        vpp_flag.append(("--microbatch-group-size-per-virtual-pipeline-stage", str(p.microbatch_group_size)))
    if is_even(sc):
        return vpp_flag
    if len(set(layers[1:-1])) <= 1 and not any(n % p.vpp for n in layers):
        return [("--decoder-first-pipeline-num-layers", str(layers[0])),
                ("--decoder-last-pipeline-num-layers", str(layers[-1]))] + vpp_flag
    return [("--pipeline-model-parallel-layout", layout_string(layers, p.vpp, sc.model.mtp_num_layers))] + vpp_flag[1:]


def uses_megatron_fsdp(sc: Scenario) -> bool:
    return sc.plan.zero_stage >= 2


#: Why a Megatron-LM launch refuses NeMo 1's Apex optimizer states (``TrainingSpec.optimizer_dtype`` bf16-apex):
#: Megatron-LM has no flag for them (planner/frameworks/nemo.py); ``planner.emit.job_problems`` says it before a search.
APEX_REFUSAL = ("optimizer_dtype bf16-apex is NeMo 1's Apex DistributedFusedAdam, which Megatron-LM does not run; use "
                "optimizer_dtype bf16 (Megatron's precision-aware optimizer) or fp32")


def parallel_flags(sc: Scenario) -> list[Flag]:
    p, tr = sc.resolved_plan(), sc.training
    flags: list[Flag] = [
        ("--tensor-model-parallel-size", str(p.tp)), ("--pipeline-model-parallel-size", str(p.pp)),
        ("--context-parallel-size", str(p.cp)),
    ]
    if sc.model.is_moe:  # parallel folding: the expert grid etp x ep x expert-dp over the same ranks
        flags.append(("--expert-model-parallel-size", str(p.ep)))
        if p.etp is not None:  # absent: Megatron's default, tp (validate_args), as the plan's None means
            flags.append(("--expert-tensor-parallel-size", str(p.etp)))
    flags += pipeline_flags(sc)
    if tr.dist_optimizer_instances > 1:  # partial distributed optimizers (core_v0.16.1 arguments.py, parallel_state.py)
        flags.append(("--num-distributed-optimizer-instances", str(tr.dist_optimizer_instances)))
    if p.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    if p.recompute == "selective" and tr.recompute_modules:  # no module: nothing to recompute, no flag
        flags += [("--recompute-granularity", "selective")]
        if tr.recompute_modules != ("core_attn",):  # TransformerConfig.recompute_modules, default core_attn (nargs +)
            flags.append(("--recompute-modules", tuple(tr.recompute_modules)))
    elif p.recompute == "full" and p.recompute_num_layers is not None:  # the first K layers of each model chunk
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "block"),
                  ("--recompute-num-layers", str(p.recompute_num_layers))]
    elif p.recompute == "full":  # groups of one layer, or of the plan's recompute_group_layers
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                  ("--recompute-num-layers", str(p.recompute_group_layers or 1))]
    if tr.distribute_saved_activations:  # the checkpointed inputs split over TP (specs.distributed_checkpoint_problems)
        flags.append(("--distribute-saved-activations", None))
    if p.cpu_offload_layers:
        # core_v0.16.1: --cpu-offloading-num-layers comes from TransformerConfig (arguments.py
        # _add_network_size_args); validate_args sets args.cpu_offloading = True when it is > 0, and
        # --cpu-offloading itself is no flag (excluded there), nor are the activation/weights switches
        # (defaults: activations on, weights off)
        flags.append(("--cpu-offloading-num-layers", str(p.cpu_offload_layers)))
    flags += ZERO_FLAGS[p.zero_stage]
    if uses_megatron_fsdp(sc):  # validate_args: "Megatron FSDP only supports fsdp_dtensor checkpoint format"
        flags.append(("--ckpt-format", "fsdp_dtensor"))
    flags += [("--micro-batch-size", str(p.micro_batch_size)), ("--global-batch-size", str(tr.global_batch_size)),
              ("--seq-length", str(tr.seq_len)), ("--fp16" if tr.fp16 else "--bf16", None)]
    flags += PRECISION_FLAGS.get(tr.precision, [])
    if tr.precision == "fp8" and tr.fp8_recipe != "delayed":  # delayed: core_v0.16.1's default
        flags.append(("--fp8-recipe", tr.fp8_recipe))
    flags.append(("--attention-backend", ATTENTION_BACKENDS[tr.attention]))
    if tr.cross_entropy_fusion != "none":  # the loss kernel the memory estimate assumed (frameworks/megatron.py)
        flags.append(("--cross-entropy-loss-fusion", None))
        if tr.cross_entropy_fusion == "te":
            flags.append(("--cross-entropy-fusion-impl", "te"))
    if tr.optimizer != "adam":  # Megatron-Core's Muon (planner.muon); validate_args refuses it with either overlap
        flags.append(("--optimizer", tr.optimizer))
    elif tr.overlap_grad_reduce:
        flags.append(("--overlap-grad-reduce", None))
        if p.zero_stage == 1:
            flags.append(("--overlap-param-gather", None))
    # gradient dtype (core_v0.16.1 arguments.py validate_args; training.py passes accumulate_allreduce_grads_in_fp32
    # as DDP's grad_reduce_in_fp32): under --bf16 fp32 unless --grad-reduce-in-bf16; under --fp16 the fp16 of the
    # weights unless --accumulate-allreduce-grads-in-fp32, and --grad-reduce-in-bf16 is not read there
    if tr.fp16 and not tr.grad_reduce_in_bf16:
        flags.append(("--accumulate-allreduce-grads-in-fp32", None))
    elif tr.grad_reduce_in_bf16 and not tr.fp16:
        flags.append(("--grad-reduce-in-bf16", None))
    if tr.optimizer_dtype == "bf16-apex":  # NeMo 1's Apex optimizer (planner/frameworks/nemo.py)
        raise SpecError(f"--emit megatron: {APEX_REFUSAL}")
    if tr.optimizer_dtype == "bf16":  # Megatron's precision-aware optimizer (planner/frameworks/megatron.py)
        if p.zero_stage != 1:  # core_v0.16.1 optimizer_config.py: "only supported with distributed optimizer"
            raise SpecError("--emit megatron: optimizer_dtype bf16 (--use-precision-aware-optimizer) needs the "
                            f"distributed optimizer; use zero_stage 1 (plan has {p.zero_stage}) or optimizer_dtype fp32")
        flags += [("--use-precision-aware-optimizer", None), ("--exp-avg-dtype", "bf16"), ("--exp-avg-sq-dtype", "bf16")]
    if tr.fp8_params:  # fp8 weights, no bf16 copy (planner/frameworks/megatron.py)
        if p.zero_stage < 1:  # core_v0.16.1 arguments.py: "--fp8-param-gather only supported with distributed optimizer, ..."
            raise SpecError("--emit megatron: fp8_params needs the distributed optimizer (Megatron --fp8-param-gather); "
                            f"use zero_stage 1 (plan has {p.zero_stage}) or drop fp8_params")
        flags.append(("--fp8-param-gather", None))
        if tr.precision == "mxfp8":  # MXFP8Tensor weights gathered through the gradient buffer (frameworks/megatron.py)
            flags.append(("--reuse-grad-buf-for-mxfp8-param-ag", None))
    flags += overlap_flags(sc)
    return flags


def overlap_flags(sc: Scenario) -> list[Flag]:
    """The TP and P2P overlap switches the cost model assumed (``cost.resolved_overlap``), as Megatron
    flags. ``--tp-comm-overlap`` only with SP (``validate_args``: "Tensor parallel communication/GEMM
    overlap can happen only when sequence parallelism is enabled"); P2P overlap is Megatron's default
    with the interleaved schedule, ``--no-overlap-p2p-communication`` turns it off (then pp > 2)."""
    from planner.cost import resolved_overlap

    p, ov = sc.plan, resolved_overlap(sc.training)
    flags: list[Flag] = []
    if ov.tp_comm_overlap and p.sequence_parallel and p.tp > 1:
        flags.append(("--tp-comm-overlap", None))
    if not ov.overlap_p2p_comm and p.vpp > 1:
        if p.pp <= 2:
            raise SpecError(f"--emit megatron: Megatron-LM needs pp > 2 for an interleaved schedule without P2P "
                            f"overlap (plan has pp={p.pp}); drop --no-overlap-p2p or raise pp")
        flags.append(("--no-overlap-p2p-communication", None))
    return flags


#: ``TrainingSpec.attention`` as Megatron-LM core_v0.16.1's ``--attention-backend`` (``AttnBackend``; the backend sets
#: Transformer Engine's NVTE_FLASH_ATTN / NVTE_FUSED_ATTN, ``language_module.py``): plan3d's "flash", the GPU's
#: fastest fused kernel, is ``auto``, Transformer Engine's own choice, which on Hopper and later prefers cuDNN's
#: FusedAttention "for performance reasons" (``get_attention_backend``) and elsewhere flash-attn; "flash2" is
#: ``flash``, the flash-attn package (FlashAttention-2; FlashAttention-3 where installed); materialised scores are
#: ``unfused``. Before 2026-12-05 both flash kinds were written ``flash``, which on an H100 forced FlashAttention-2
#: under a plan costed at cuDNN's speed.
ATTENTION_BACKENDS = {"flash": "auto", "flash2": "flash", "materialized": "unfused"}

#: Transformer Engine recipes as Megatron-LM core_v0.16.1 names them (``TransformerConfig.fp8``/``fp8_recipe``,
#: ``fp4``/``fp4_recipe``): fp8 per-tensor "hybrid" (E4M3 forward, E5M2 gradients) with the default
#: recipe (delayed scaling in core_v0.16.1; ``fp8_recipe: tensorwise`` or ``blockwise`` adds ``--fp8-recipe`` with it:
#: Float8CurrentScaling, Float8BlockScaling, core_v0.16.1 ``fp8_utils.py`` ``get_fp8_recipe``); MXFP8 is E4M3 throughout (TE ``MXFP8BlockScaling``); NVFP4 is E2M1 (TE
#: ``NVFP4BlockScaling``, Transformer Engine >= 2.7).
PRECISION_FLAGS: dict[str, list[Flag]] = {
    "fp8": [("--fp8-format", "hybrid")],
    "mxfp8": [("--fp8-format", "e4m3"), ("--fp8-recipe", "mxfp8")],
    "nvfp4": [("--fp4-format", "e2m1"), ("--fp4-recipe", "nvfp4")],
}


def run_flags(sc: Scenario) -> list[Flag]:
    """What a benchmark run needs besides the plan: synthetic data, a null tokenizer, a few steps; no s x s
    attention mask from the dataloader unless the job asks for it (``TrainingSpec.attention_mask_in_dataloader``:
    Megatron-LM builds one per micro-batch by default, which Transformer Engine's causal attention does not read);
    the job's bf16 end layers and deferred output-layer weight gradients (``TrainingSpec.bf16_layers_at_start/end``,
    ``defer_embedding_wgrad``), as the plan was sized."""
    tr = sc.training
    job = [] if tr.attention_mask_in_dataloader else [("--no-create-attention-mask-in-dataloader", None)]
    if tr.bf16_layers_at_start or tr.bf16_layers_at_end:  # TrainingSpec.bf16_layers_at_start/end
        job += [("--first-last-layers-bf16", None), ("--num-layers-at-start-in-bf16", str(tr.bf16_layers_at_start)),
                ("--num-layers-at-end-in-bf16", str(tr.bf16_layers_at_end))]
    if tr.defer_embedding_wgrad:  # TrainingSpec.defer_embedding_wgrad: the job was sized with the deferred lists
        job.append(("--defer-embedding-wgrad-compute", None))
        if tr.wgrad_deferral_limit:
            job.append(("--wgrad-deferral-limit", str(tr.wgrad_deferral_limit)))
    return [("--mock-data", None), ("--tokenizer-type", "NullTokenizer"), *job, ("--train-iters", "${TRAIN_ITERS:-20}"),
            ("--lr", "1.0e-4"), ("--lr-decay-style", "constant"), ("--log-interval", "1")]


def schedule_refusals(sc: Scenario, framework: str) -> list[str]:
    """``--emit <framework>``: the plan's pipeline schedule, when the framework does not run it
    (``schedules.schedule_problems``: Megatron-Core core_v0.16.1 runs 1F1B and interleaved 1F1B only)."""
    p = sc.plan
    if p.pipeline_schedule is None:
        return []
    from planner.schedules import schedule_problems

    return [f"--emit {framework}: {line}" for line in
            schedule_problems(p.pipeline_schedule, framework, p.pp, p.vpp, sc.num_microbatches, p.microbatch_group_size)]


def megatron_flags(sc: Scenario) -> list[Flag]:
    """Every Megatron-LM flag of the plan, in order; a MoE plan Megatron-LM would refuse is refused."""
    refusals = schedule_refusals(sc, "megatron") + moe_plan_refusals(sc)
    if sc.plan.recompute_interval is not None:  # Megatron recomputes the first K of a chunk, or N at a time
        refusals.append(f"--emit megatron: Megatron has no per-layer AC (one layer in every {sc.plan.recompute_interval}, "
                        "torchtitan's selective_ac_option); use recompute_num_layers (--recompute-method block) "
                        "or drop recompute_interval")
    if refusals:
        raise SpecError(refusals)
    return model_flags(sc) + parallel_flags(sc) + run_flags(sc) + cuda_graph_flags(sc)


def cuda_graph_flags(sc: Scenario) -> list[Flag]:
    """The job's ``cuda_graph_modules`` as Megatron-LM core_v0.16.1 captures them: ``--cuda-graph-impl
    transformer_engine`` (TE ``make_graphed_callables`` per layer) with ``--cuda-graph-scope`` listing the
    parts (``arguments.py``: attn, moe_router, moe_preprocess, moe; moe_preprocess only with moe_router, moe only
    with drop-and-pad routing, ``specs.cuda_graph_problems``)."""
    modules = sc.training.cuda_graph_modules
    if not modules:
        return []
    if not sc.model.is_moe and any(m.startswith("moe") for m in modules):
        raise SpecError(f"--emit megatron: cuda_graph_modules {', '.join(modules)}: the moe_* scopes need a MoE "
                        "model; keep attn only")
    return [("--cuda-graph-impl", "transformer_engine"), ("--cuda-graph-scope", tuple(modules))]


def annotations(sc: Scenario) -> list[str]:
    """Facts no Megatron-LM flag carries, as ``# plan3d: key=value`` comments that `plan3d check` reads:
    the model's name (as its slug: a name may hold newlines or shell syntax), the GPU count (the
    launcher carries it in scripts, not in an argument file), the hardware profile when it is a bundled
    one unchanged (:func:`bundled_hardware_name`: `check` then needs no ``--hardware``) and a BLOOM-style
    embedding norm."""
    notes = [f"name={slug(sc.model.name)}", f"num_gpus={sc.training.num_gpus}"]
    hardware = bundled_hardware_name(sc.hardware)
    if hardware is not None:
        notes.append(f"hardware={hardware}")
    if sc.model.embedding_norm:
        notes.append("embedding_norm=true")
    return notes


def bundled_hardware_name(hw) -> str | None:
    """The name of the bundled hardware profile ``hw`` is, field for field, or None (a profile file of the
    user's, or a bundled one edited or calibrated): only such a name is written for `plan3d check` to load,
    so a check never judges by figures other than the plan's."""
    from planner.presets import HARDWARE_DIRNAME, load_hardware, preset_names

    if hw.name not in preset_names(HARDWARE_DIRNAME):
        return None
    return hw.name if load_hardware(hw.name) == hw else None


def args_block(flags: list[Flag], indent: str = "  ", quote: bool = True) -> str:
    """One flag per line. In a script (``quote``) every value is one shell word (``shlex.quote``), or a
    ``${VAR:-default}`` expansion in double quotes; an argument file keeps values as they are."""
    lines = []
    for flag, value in flags:
        if value is None:
            lines.append(f"{indent}{flag}")
        elif isinstance(value, tuple):
            lines.append(f"{indent}{flag} " + " ".join(shlex.quote(v) if quote else v for v in value))
        elif value.startswith("${"):
            lines.append(f'{indent}{flag} "{value}"' if quote else f"{indent}{flag} {value}")
        else:
            lines.append(f"{indent}{flag} {shlex.quote(value) if quote else value}")
    return "\n".join(lines)


def header(sc: Scenario, what: str) -> str:
    """Comment lines naming the plan. Names appear only as slugs (``planner.names.slug``), so nothing
    from a model or hardware name can end a comment line or run as a command."""
    notes = "\n".join(f"# plan3d: {n}" for n in annotations(sc))
    return (f"# {what} for {slug(sc.model.name)}: {sc.plan.label()} on {sc.training.num_gpus} x "
            f"{slug(sc.hardware.name, 'gpu')}\n"
            f"# Written by plan3d; `plan3d check` reads this file back.\n{notes}\n")


def env_lines(sc: Scenario) -> str:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` as Megatron-LM core_v0.16.1 ``validate_args`` demands it: 1 for
    tensor/context parallelism (before Blackwell), anything but 1 with Megatron FSDP (ZeRO-2/3); and HybridEP's
    NVLink-domain variables (:func:`hybridep_env`)."""
    if uses_megatron_fsdp(sc):
        lines = ("# Megatron FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron/training/arguments.py)\n"
                 "unset CUDA_DEVICE_MAX_CONNECTIONS")
    else:
        lines = "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    return "\n".join([lines] + [f"export {name}={value}" for name, value in hybridep_env(sc)])


def hybridep_env(sc: Scenario) -> list[tuple[str, str]]:
    """The variables HybridEP reads to place the expert group on NVLink domains, for a job that dispatches with it:
    the group's ranks per domain (``memory.hybridep_domain_ranks``, what plan3d sizes its buffer with) under both
    names HybridEP has used (``NUM_OF_RANKS_PER_NVLINK_DOMAIN``, deepseek-ai/DeepEP hybrid-ep
    ``deep_ep/hybrid_ep_buffer.py`` @ 098da2a6, default 8; ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` later, as
    NVIDIA's Megatron-Bridge recipes set it), and ``USE_MNNVL=1`` where a domain holds more than 8 of them (the
    fabric memory an NVL72 rack shares; that version turns it on itself above 8)."""
    if sc.training.moe_token_dispatcher != "hybridep" or not sc.model.is_moe:
        return []
    ranks, _ = hybridep_domain_ranks(sc.training, sc.plan, sc.hardware)
    out = [("NUM_OF_RANKS_PER_NVLINK_DOMAIN", str(ranks)), ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", str(ranks))]
    return out + [("USE_MNNVL", "1")] if ranks > 8 else out


def env_note(sc: Scenario) -> str:
    extra = "".join(f"# Run with {name}={value} (HybridEP's NVLink domain).\n" for name, value in hybridep_env(sc))
    if uses_megatron_fsdp(sc):
        return "# Run with CUDA_DEVICE_MAX_CONNECTIONS unset (Megatron FSDP refuses 1).\n" + extra
    return ("# Run with CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM requires it for tensor/context parallelism).\n"
            + extra)


def render_args(sc: Scenario) -> str:
    """An argument file: one Megatron-LM flag per line, comments allowed (`plan3d check` reads it;
    pass it on with ``$(grep -v '^#' FILE)``)."""
    body = args_block(megatron_flags(sc), indent="", quote=False).replace("${TRAIN_ITERS:-20}", "20")
    return header(sc, "Megatron-LM pretrain_gpt.py arguments") + env_note(sc) + body + "\n"


def render(sc: Scenario, launcher: str) -> str:
    """A bash script that runs ``pretrain_gpt.py`` with the plan under the given launcher line."""
    return f"""#!/usr/bin/env bash
{header(sc, "Megatron-LM pretrain_gpt.py under torchrun")}# MEGATRON_LM points at a Megatron-LM checkout.
set -euo pipefail
MEGATRON_LM="${{MEGATRON_LM:-$PWD/Megatron-LM}}"
{env_lines(sc)}

MEGATRON_ARGS=(
{args_block(megatron_flags(sc))}
)

{launcher} "$MEGATRON_LM/pretrain_gpt.py" "${{MEGATRON_ARGS[@]}}" "$@"
"""
