"""Megatron-LM (and Megatron-DeepSpeed) arguments -> a plan3d scenario, as Megatron reads them.

Every default and normalisation below is Megatron-LM core_v0.16.1's, cited by code path
(``megatron/training/arguments.py`` unless said otherwise):

* ``--ffn-hidden-size`` absent: ``4 * h``, or with ``--swiglu`` ``int((4 * h * 2 / 3) / 64) * 64``
  (``validate_args``, "if args.ffn_hidden_size is None");
* ``--kv-channels`` absent: ``h // heads`` (``validate_args``);
* ``--group-query-attention`` without ``--num-query-groups``: 1 group
  (``megatron/core/transformer/transformer_config.py``, ``num_query_groups`` argparse default 1);
  ``--num-query-groups`` without ``--group-query-attention`` is ignored (``core_transformer_config_from_args``:
  ``kw_args['num_query_groups'] = None``);
* ``--sequence-parallel`` with tp = 1: turned off, not an error (``validate_args``, "disable sequence
  parallelism when tp=1");
* ``--global-batch-size`` absent: ``micro_batch_size * dp`` (``validate_args``);
* ``--recompute-activations``: ``--recompute-granularity selective`` (``validate_args``);
* ``--cpu-offloading-num-layers N``: offloading on only for ``N > 0`` (``validate_args``), read as
  ``Plan.cpu_offload_layers``;
* virtual pipeline: ``(num_layers / pp) / --num-layers-per-virtual-pipeline-stage``, or
  ``--num-virtual-stages-per-pipeline-rank`` (``validate_args``);
* dropout 0.1 (``--attention-dropout``/``--hidden-dropout`` defaults), LayerNorm
  (``--normalization`` default), learned absolute positions (``--position-embedding-type`` default),
  biases on (``--disable-bias-linear`` absent), tied embeddings (``--untie-embeddings-and-output-weights``
  absent);
* vocabulary: the tokenizer's size (``megatron/training/tokenizer/tokenizer.py::build_tokenizer``),
  padded up to a multiple of ``--make-vocab-size-divisible-by`` (default 128) x tp
  (``_vocab_size_with_padding``); ``--padded-vocab-size`` is used as given.
"""

from __future__ import annotations

import math
import re

from planner.presets import SpecError
from planner.readers.args import Args
from planner.specs import moe_layer_fields

# The tokenizer's vocabulary (``tokenizer.vocab_size`` as Megatron builds it), per tokenizer and,
# for Hugging Face tokenizers, per model family (matched in --tokenizer-model).
GPT2_BPE_VOCAB = 50257     # Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", sec. 2.2
LLAMA2_VOCAB = 32000       # Touvron et al. 2023, "Llama 2", sec. 2.1 ("total vocabulary size is 32k tokens");
#                            meta-llama/Llama-2-7b-hf config.json vocab_size 32000
LLAMA3_VOCAB = 128256      # meta-llama/Meta-Llama-3-8B config.json vocab_size 128256 = len(tokenizer):
#                            128,000 BPE tokens + 256 special (Llama 3 Herd paper, sec. 3.1 "128K tokens")
MISTRAL_VOCAB = 32000      # Jiang et al. 2023, "Mistral 7B", Table 1 (vocab_size 32000)
TIKTOKEN_DEFAULT_VOCAB = 2**17  # tokenizer.py CustomTikTokenizer: "Fallback vocab size is 131072"
HF_TOKENIZERS = [          # (pattern in --tokenizer-model, vocab, source)
    (re.compile(r"llama-?3|llama3", re.I), LLAMA3_VOCAB, "Llama-3 tokenizer (128,256 tokens)"),
    (re.compile(r"llama-?2|llama2", re.I), LLAMA2_VOCAB, "Llama-2 tokenizer (32,000 tokens)"),
    (re.compile(r"mistral-7b", re.I), MISTRAL_VOCAB, "Mistral-7B tokenizer (32,000 tokens)"),
    (re.compile(r"(^|/)gpt2$", re.I), GPT2_BPE_VOCAB, "GPT-2 BPE (50,257 tokens)"),
]
SENTENCEPIECE_TOKENIZERS = [
    (re.compile(r"llama-?2|llama2", re.I), LLAMA2_VOCAB, "Llama-2 tokenizer.model (32,000 pieces)"),
]

# Flags for models plan3d does not model: refused, never read as a dense GPT.
UNMODELLED_FLAGS = {
    "--moe-latent-size": "MoE latent projections (--moe-latent-size)",
    "--hybrid-override-pattern": "a hybrid Mamba-Transformer model (--hybrid-override-pattern)",
    "--hybrid-attention-ratio": "a hybrid Mamba-Transformer model (--hybrid-attention-ratio)",
    "--hybrid-mlp-ratio": "a hybrid Mamba-Transformer model (--hybrid-mlp-ratio)",
    "--is-hybrid-model": "a hybrid Mamba-Transformer model (--is-hybrid-model)",
    "--ds-sequence-parallel-size": "DeepSpeed-Ulysses sequence parallelism (--ds-sequence-parallel-size)",
    # Nemotron-NAS style blocks: each layer's attention and FFN from a JSON file (core_v0.16.1
    # transformer/heterogeneous/heterogeneous_config.py), not the uniform layer the flags describe
    "--heterogeneous-layers-config-path": "heterogeneous per-layer blocks (--heterogeneous-layers-config-path)",
    "--heterogeneous-layers-config-encoded-json": "heterogeneous per-layer blocks "
                                                  "(--heterogeneous-layers-config-encoded-json)",
    # core_v0.16.1 TransformerConfig.experimental_attention_variant: gated_delta_net (linear-attention layers, every
    # one but each --linear-attention-freq-th) or dsa (DeepSeek sparse attention with its indexer)
    "--experimental-attention-variant": "gated-delta-net or sparse (DSA) attention layers "
                                        "(--experimental-attention-variant)",
    # TransformerConfig.attention_output_gate: a gate projection on every attention layer's output
    "--attention-output-gate": "a gated attention output (--attention-output-gate)",
}
# (flag, values it is refused at, what, why, Megatron-DeepSpeed too) for settings of a model plan3d does model, which
# it would otherwise read as its own default.
UNMODELLED_VALUES = (
    # TransformerConfig.fp32_residual_connection (legacy and Megatron-DeepSpeed the same): the residual stream, and
    # so every layer's normalisation inputs, kept in fp32 where plan3d counts 16-bit values
    ("--fp32-residual-connection", lambda v: True, "an fp32 residual stream (--fp32-residual-connection)",
     "plan3d counts 16-bit activations and would under-count them", True),
    # core_v0.16.1 arguments.py core_transformer_config_from_args: load_quantization_recipe(file), per-module
    # precision overrides of Transformer Engine's GEMMs (what each saves for backward with them)
    ("--te-precision-config-file", lambda v: True, "per-module precision overrides (--te-precision-config-file)",
     "plan3d gives every layer's GEMMs, and the inputs they save, the launch's one precision", False),
    # core_v0.16.1 arguments.py parse_args: the whole namespace is replaced by yaml_arguments.load_yaml(file)
    ("--yaml-cfg", lambda v: True, "arguments from a YAML file (--yaml-cfg)",
     "Megatron takes every setting from the file, plan3d reads the command line", False),
)


def _refuse_unmodelled(a: Args) -> None:
    if a.has("--deepspeed") and a.has("--num-experts"):  # Megatron-DeepSpeed's --num-experts: a list (nargs '+')
        counts = a.values["--num-experts"]
        counts = counts if isinstance(counts, list) else [counts]
        if not all(str(c).isdigit() and int(str(c)) <= 1 for c in counts):  # 1 expert is a dense model
            raise SpecError(f"{a.path}:{a.line('--num-experts')}: DeepSpeed-MoE (Megatron-DeepSpeed --num-experts) is "
                            "not modelled by plan3d; it would be read as a dense GPT, so the file is refused")
    for flag, what in UNMODELLED_FLAGS.items():
        if not a.has(flag):
            continue
        value = a.values[flag]
        if flag == "--ds-sequence-parallel-size":
            counts = value if isinstance(value, list) else [value]
            try:
                if all(int(str(c)) <= 1 for c in counts):  # a Ulysses degree of 1 splits nothing
                    continue
            except ValueError:
                pass
        raise SpecError(f"{a.path}:{a.line(flag)}: {what} is not modelled by plan3d; it would be read as a dense "
                        "GPT and under-count memory, so the file is refused")
    wgrad_flag = next((f for f in ("--no-fp8-wgrad", "--disable-fp8-wgrad") if a.has(f)), None)
    if (wgrad_flag and a.has("--fp8-format") and a.get("--fp8-recipe", "delayed") == "delayed"
            and not a.has("--deepspeed")):
        # fp8_utils.get_fp8_recipe: TEDelayedScaling(override_linear_precision=(False, False, not fp8_wgrad))
        raise SpecError(f"{a.path}:{a.line(wgrad_flag)}: {wgrad_flag} is not modelled: the weight-gradient GEMMs run "
                        "in bf16 (Transformer Engine's override_linear_precision) and keep 16-bit inputs where plan3d "
                        "counts FP8 ones, so the file is refused")
    if not a.has("--deepspeed") and a.get("--optimizer") in ("muon", "dist_muon"):
        # core_v0.16.1 arguments.py validate_args: "Muon optimizer does not support overlap grad reduce / overlap
        # param gather for now" (the distributed optimizer: specs.muon_problems, through the ZeRO stage read)
        for flag in ("--overlap-grad-reduce", "--overlap-param-gather"):
            if a.has(flag):
                raise SpecError(f"{a.path}:{a.line(flag)}: Megatron refuses {flag} with --optimizer "
                                f"{a.get('--optimizer')} (validate_args: Muon runs without it); drop {flag}")
        # planner.muon models --muon-tp-mode blockwise (the default): each TP rank orthogonalises its own shard. The
        # duplicated and distributed modes gather the whole matrix, or reduce X X^T across the ranks, at the step
        # (Emerging-Optimizers newton_schulz_tp), more memory than counted
        if a.get("--muon-tp-mode", "blockwise") != "blockwise":
            raise SpecError(f"{a.path}:{a.line('--muon-tp-mode')}: --muon-tp-mode {a.get('--muon-tp-mode')} is not "
                            "modelled: Newton-Schulz on the gathered matrix holds more at the step than plan3d counts "
                            "(blockwise, the default, is), so the file is refused")
        # with --moe-use-legacy-grouped-gemm (GroupedMLP) a rank's experts are one weight per linear, dealt whole by
        # dist_muon (layer_wise_optimizer.py shard_params), where planner.muon deals one weight per expert (TEGroupedMLP)
        if a.get("--optimizer") == "dist_muon" and a.has("--moe-use-legacy-grouped-gemm") and a.has("--num-experts"):
            raise SpecError(f"{a.path}:{a.line('--moe-use-legacy-grouped-gemm')}: --moe-use-legacy-grouped-gemm with "
                            "dist_muon is not modelled: the local experts form one weight per linear, dealt whole to "
                            "one rank, where plan3d deals one weight per expert, so the file is refused")
    for flag, refused, what, why, deepspeed_too in UNMODELLED_VALUES:
        if a.has(flag) and refused(a.get(flag)) and (deepspeed_too or not a.has("--deepspeed")):
            raise SpecError(f"{a.path}:{a.line(flag)}: {what} is not modelled: {why}, so the file is refused")


def swiglu_ffn_default(h: int) -> int:
    """Megatron's --swiglu FFN width when --ffn-hidden-size is absent: ``int((4h * 2/3) / 64) * 64``
    (arguments.py ``validate_args``)."""
    return int((4 * h * 2 / 3) / 64) * 64


def vocab(a: Args, tp: int, override: int | None, notes: list[str]) -> int:
    """The vocabulary to give plan3d's estimator (which pads by 128 x tp itself).

    Megatron's padded size is ``ceil(V / (d * tp)) * d * tp`` with d = --make-vocab-size-divisible-by
    (tokenizer.py ``_vocab_size_with_padding``). With d = 128 the unpadded V is returned, and the
    estimator pads it exactly as Megatron does; with another d (or --padded-vocab-size) Megatron's
    padded size is returned, which the estimator may pad further (a note says by how much).
    """
    divisor = a.count("--make-vocab-size-divisible-by", 128)
    if override is not None:
        size, source = override, f"--vocab-size {override} given to plan3d check"
    elif a.has("--padded-vocab-size") or a.has("--pad-vocab-size-to"):
        # --pad-vocab-size-to: BigScience Megatron-DeepSpeed (BLOOM), the padded size itself
        flag = "--padded-vocab-size" if a.has("--padded-vocab-size") else "--pad-vocab-size-to"
        padded = a.count(flag)
        notes.append(f"vocabulary: {flag} {padded}, used as given")
        return padded
    else:
        size, source = _tokenizer_vocab(a)
    notes.append(f"vocabulary: {source}")
    if divisor == 128:
        return size
    step = divisor * tp
    padded = int(math.ceil(size / step) * step)
    est = int(math.ceil(padded / (128 * tp)) * 128 * tp)
    if est != padded:
        notes.append(f"vocabulary: Megatron pads {size} to {padded} (--make-vocab-size-divisible-by {divisor}); "
                     f"plan3d's estimator pads to {est} (128 x tp), {est - padded} rows more")
    return padded


def _tokenizer_vocab(a: Args) -> tuple[int, str]:
    kind = a.get("--tokenizer-type")
    # --tokenizer-name-or-path: Megatron-DeepSpeed's PretrainedFromHF tokenizer (BigScience)
    model = a.get("--tokenizer-model") or a.get("--tokenizer-name-or-path") or ""
    given = a.int("--vocab-size")
    if kind is None and a.has("--merge-file"):
        kind = "GPT2BPETokenizer"  # only GPT-2 BPE takes --vocab-file plus --merge-file (Megatron-LM examples/gpt3)
    if kind == "NullTokenizer":
        if given is None:
            raise SpecError(f"{a.path}:{a.line('--tokenizer-type')}: --tokenizer-type NullTokenizer needs --vocab-size "
                            "(Megatron asserts it)")
        return given + 1, f"NullTokenizer: --vocab-size {given} + 1 end-of-document token (tokenizer.py _NullTokenizer)"
    if kind == "TikTokenizer":
        size = given or TIKTOKEN_DEFAULT_VOCAB
        return size, f"TikTokenizer: {'--vocab-size' if given else 'its default'} {size} (tokenizer.py CustomTikTokenizer)"
    if kind == "GPT2BPETokenizer":
        return GPT2_BPE_VOCAB, "GPT2BPETokenizer: GPT-2's 50,257 tokens"
    if kind == "Llama2Tokenizer":
        return LLAMA2_VOCAB, "Llama2Tokenizer: Llama-2's 32,000 pieces"
    table = HF_TOKENIZERS if kind == "HuggingFaceTokenizer" else SENTENCEPIECE_TOKENIZERS \
        if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer") else []
    for pattern, size, source in table:
        if pattern.search(model):
            return size, f"{kind} {model}: {source}"
    if given is not None:
        return given, (f"--vocab-size {given} taken as the size of {kind or 'the tokenizer'} {model}".rstrip()
                       + " (Megatron itself takes the size from the tokenizer files)")
    raise SpecError(f"{a.path}:{a.line('--tokenizer-type', '--tokenizer-model')}: cannot tell the vocabulary of "
                    f"{kind or 'the tokenizer (no --tokenizer-type)'} {model}".rstrip() + "; add --vocab-size N to the "
                    "arguments or pass --vocab-size N to plan3d check")


def model_dict(a: Args, tp: int, vocab_override: int | None, notes: list[str], name: str,
               file_notes: dict | None = None) -> dict:
    """ModelSpec fields from Megatron's arguments and defaults (see the module docstring)."""
    _refuse_unmodelled(a)
    file_notes = file_notes or {}
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        if not a.has(flag):
            raise SpecError(f"{a.path}:{a.line0}: no {flag}: Megatron-LM requires it (validate_args required_args)")
    h, heads = a.int("--hidden-size"), a.int("--num-attention-heads")
    swiglu = a.has("--swiglu") or a.has("--quick-geglu")
    ffn = a.int("--ffn-hidden-size")
    if ffn is None:
        ffn = swiglu_ffn_default(h) if swiglu else 4 * h
        notes.append(f"--ffn-hidden-size absent: Megatron uses {ffn} "
                     f"({'int(4h*2/3/64)*64 with --swiglu' if swiglu else '4h'})")
    groups = None
    if a.has("--num-key-value-heads"):  # Megatron-DeepSpeed's GQA flag (megatron/arguments.py)
        groups = a.int("--num-key-value-heads")
    if a.has("--group-query-attention"):
        groups = a.int("--num-query-groups", 1)
        if not a.has("--num-query-groups"):
            notes.append("--group-query-attention without --num-query-groups: Megatron uses 1 group")
    kv = a.int("--kv-channels")
    pos_type = a.get("--position-embedding-type", "learned_absolute")
    if a.has("--use-rotary-position-embeddings"):
        pos_type = "rope"
    if a.has("--no-position-embedding"):
        pos_type = "none"
    if pos_type == "relative":
        raise SpecError(f"{a.path}:{a.line('--position-embedding-type')}: relative position embeddings (T5) are "
                        "not modelled")
    # Megatron-LM's choices, and Megatron-DeepSpeed's (BigScience's PositionEmbeddingType: absolute, rotary, alibi)
    pos = {"learned_absolute": "learned", "rope": "rope", "mrope": "rope", "none": "alibi", "absolute": "learned",
           "rotary": "rope", "alibi": "alibi"}.get(pos_type)
    if pos is None:
        raise SpecError(f"{a.path}:{a.line('--position-embedding-type')}: --position-embedding-type {pos_type}: "
                        "not a type plan3d knows (learned_absolute, rope, mrope, none; Megatron-DeepSpeed's absolute, "
                        "rotary, alibi); use one of those")
    seq = a.int("--seq-length")
    max_pos = a.int("--max-position-embeddings")
    if max_pos is None:
        if pos == "learned":
            raise SpecError(f"{a.path}:{a.line0}: no --max-position-embeddings: Megatron-LM requires it "
                            "(validate_args required_args)")
        max_pos = seq
    dropout = a.float("--attention-dropout", 0.1) > 0 or a.float("--hidden-dropout", 0.1) > 0
    mla = a.has("--multi-latent-attention")
    if mla and a.has("--group-query-attention"):
        raise SpecError(f"{a.path}:{a.line('--group-query-attention')}: --group-query-attention with "
                        "--multi-latent-attention: Megatron-LM refuses the pair (validate_args)")
    if a.has("--qk-l2-norm"):
        raise SpecError(f"{a.path}:{a.line('--qk-l2-norm')}: Llama-4 style Q/K L2 norms (--qk-l2-norm) are not modelled")
    softmax = a.get("--softmax-type", "vanilla")
    if softmax == "off-by-one":
        notes.append("--softmax-type off-by-one: a fixed offset, no parameters")
    linear_bias = not a.has("--disable-bias-linear")
    return {
        "name": name, "num_layers": a.int("--num-layers"), "hidden_size": h, "num_attention_heads": heads,
        "num_kv_heads": groups,
        # MLA takes its head widths from --qk-head-dim/--qk-pos-emb-head-dim/--v-head-dim; --kv-channels is unused
        # there (core_v0.16.1 multi_latent_attention.py never reads config.kv_channels)
        "head_dim": kv if kv is not None and kv * heads != h and not mla else None,
        "ffn_hidden_size": ffn, "vocab_size": vocab(a, tp, vocab_override, notes), "max_seq_len": max_pos,
        "activation": "swiglu" if swiglu else "squared_relu" if a.has("--squared-relu") else "gelu",
        "norm": "rmsnorm" if str(a.get("--normalization", "LayerNorm")).lower() == "rmsnorm" else "layernorm",
        "tied_embeddings": not a.has("--untie-embeddings-and-output-weights"),
        "position_embedding": pos, "linear_bias": not a.has("--disable-bias-linear"),
        "rotary_percent": a.float("--rotary-percent", 1.0) if pos == "rope" and not mla else 1.0,
        "qkv_bias": True if a.has("--add-qkv-bias") else None, "dropout": dropout,
        "mtp_num_layers": a.int("--mtp-num-layers", 0) or 0,
        # a LayerNorm after the word embedding: Megatron-DeepSpeed's --embed-layernorm (BLOOM), or the
        # '# plan3d: embedding_norm=true' note plan3d emit writes (Megatron-LM has no such flag)
        "embedding_norm": a.has("--embed-layernorm") or file_notes.get("embedding_norm") == "true",
        # per-head Q/K norms (TransformerConfig.qk_layernorm); with MLA the flag builds the latent norms
        "qk_norm": "head" if a.has("--qk-layernorm") and not mla else "none",
        "attention_sinks": softmax == "learnable",  # dot_product_attention.py: one learned offset per head
    } | mla_fields(a, notes) | moe_fields(a, ffn, linear_bias, notes)


def mla_fields(a: Args, notes: list[str]) -> dict:
    """MLA ranks and head widths from ``--multi-latent-attention`` and its flags, with Megatron-LM
    core_v0.16.1's argparse defaults (``_add_mla_args``: ``--kv-lora-rank`` 32, ``--qk-head-dim`` 128,
    ``--qk-pos-emb-head-dim`` 64, ``--v-head-dim`` 128, ``--q-lora-rank`` None = a full q projection).
    ``--qk-head-dim`` is the non-rotary part of a head (DeepSeek ``qk_nope_head_dim``)."""
    if not a.has("--multi-latent-attention"):
        return {}
    defaults = {"--kv-lora-rank": 32, "--qk-head-dim": 128, "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128}
    absent = [f for f in defaults if not a.has(f)]
    if absent:
        notes.append(f"MLA: Megatron's defaults for {', '.join(f'{f} {defaults[f]}' for f in absent)}")
    if not a.has("--qk-layernorm"):
        notes.append("MLA without --qk-layernorm: Megatron builds no latent norms; plan3d counts them "
                     "(2 x rank weights per layer, an upper bound)")
    return {"q_lora_rank": a.count("--q-lora-rank"), "kv_lora_rank": a.count("--kv-lora-rank", 32),
            "qk_nope_head_dim": a.count("--qk-head-dim", 128), "qk_rope_head_dim": a.count("--qk-pos-emb-head-dim", 64),
            "v_head_dim": a.count("--v-head-dim", 128)}


MAX_PATTERN_LAYERS = 100_000  # bounds what `plan3d check` unrolls from a --moe-layer-freq it is given


def eval_layer_pattern(text: str, where: str) -> list[int]:
    """A ``--moe-layer-freq`` list expression such as ``([0]*3+[1]*58)``, evaluated as Megatron's
    ``_eval_pattern`` does (core_v0.16.1 ``arguments.py``: digits, ``,``, ``[]``, ``()``, ``+``, ``*``;
    Python's list arithmetic) but without ``eval``: Python's ``ast`` walked for list literals of integers,
    ``+`` and ``*`` only, each list bounded."""
    import ast

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [walk(e) for e in node.elts]
            if not all(isinstance(i, int) for i in items):
                raise ValueError("a list holds only integers")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            lists = isinstance(left, list) + isinstance(right, list)
            if isinstance(node.op, ast.Add):
                if lists == 1:
                    raise ValueError("'+' joins two lists or two integers")
                out = left + right
            elif lists == 2:
                raise ValueError("'*' repeats a list a whole number of times")
            elif lists == 1:
                seq, count = (left, right) if isinstance(left, list) else (right, left)
                if len(seq) * max(count, 0) > MAX_PATTERN_LAYERS:
                    raise ValueError(f"longer than {MAX_PATTERN_LAYERS} layers")
                out = seq * count
            else:
                if abs(left) > MAX_PATTERN_LAYERS or abs(right) > MAX_PATTERN_LAYERS:
                    raise ValueError(f"a count above {MAX_PATTERN_LAYERS}")
                out = left * right
            if isinstance(out, list) and len(out) > MAX_PATTERN_LAYERS:
                raise ValueError(f"longer than {MAX_PATTERN_LAYERS} layers")
            return out
        raise ValueError("only integer lists, '+' and '*' are allowed")

    if re.search(r"[^,\d\[\]()+*]", text) or len(text) > 10_000:
        raise SpecError(f"{where}: --moe-layer-freq '{text[:40]}': Megatron allows only digits, ',', '[]', '()', "
                        "'+' and '*' (arguments.py _eval_pattern)")
    try:
        value = walk(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError) as err:
        raise SpecError(f"{where}: --moe-layer-freq '{text[:40]}' is not a list expression: {err}") from None
    if not isinstance(value, list):
        raise SpecError(f"{where}: --moe-layer-freq '{text[:40]}' is not a list")
    return value


def moe_layers(a: Args, num_layers: int) -> dict:
    """Which layers have experts, from ``--moe-layer-freq`` (core_v0.16.1 ``gpt_layer_specs.py``: an integer N puts
    experts on layers ``i % N == 0``; a list marks each layer, 1 = MoE), as ModelSpec fields: ``first_k_dense`` for
    dense layers first, then experts (DeepSeek's ``first_k_dense_replace``), else ``moe_layer_pattern``. A pattern
    with no MoE layer, or entries other than 0 and 1, is refused."""
    if not a.has("--moe-layer-freq"):
        return {"first_k_dense": 0}
    raw, where = str(a.get("--moe-layer-freq")), f"{a.path}:{a.line('--moe-layer-freq')}"
    if "[" in raw:
        pattern = eval_layer_pattern(raw, where)
    else:
        try:
            freq = int(raw)
        except ValueError:
            raise SpecError(f"{where}: --moe-layer-freq '{raw[:40]}' is neither an integer nor a list") from None
        if freq < 1:
            raise SpecError(f"{where}: --moe-layer-freq {freq} must be at least 1")
        pattern = [int(i % freq == 0) for i in range(num_layers)]
    if len(pattern) != num_layers:
        raise SpecError(f"{where}: --moe-layer-freq lists {len(pattern)} layers, --num-layers is {num_layers} "
                        "(Megatron asserts they match)")
    if any(x not in (0, 1) or isinstance(x, bool) for x in pattern):
        raise SpecError(f"{where}: --moe-layer-freq {raw[:40]}: a pattern marks each layer 0 (dense) or 1 (MoE)")
    if not any(pattern):
        raise SpecError(f"{where}: --moe-layer-freq {raw[:40]} puts experts on no layer; drop --num-experts for a "
                        "dense model")
    return moe_layer_fields(pattern)


def unpadded_capacity(a: Args) -> bool:
    """A capacity factor (``--moe-expert-capacity-factor`` above 0) without ``--moe-pad-expert-input-to-capacity``:
    tokens over capacity dropped, the rest not padded, so Megatron's dispatcher still syncs on the token counts
    (core_v0.16.1 moe/token_dispatcher.py, ``drop_and_pad``). plan3d reads it as padded (:func:`moe_fields`)."""
    return a.float("--moe-expert-capacity-factor", -1.0) > 0 and not a.has("--moe-pad-expert-input-to-capacity")


def moe_fields(a: Args, ffn: int, linear_bias: bool, notes: list[str]) -> dict:
    """Mixture-of-experts fields from Megatron-LM core_v0.16.1's flags and defaults (``TransformerConfig``):
    ``--moe-router-topk`` 2, ``--moe-ffn-hidden-size`` = ``--ffn-hidden-size`` (``validate_args``), the
    router's bias = ``--add-bias-linear`` (``moe/router.py``), ``--moe-router-dtype`` absent = the
    parameters' dtype, ``--moe-expert-capacity-factor`` below 0 = dropless (``TransformerConfig``),
    ``--moe-shared-expert-gate`` effective only with a shared expert; ``--moe-router-num-groups`` with
    ``--moe-router-group-topk``: group-limited routing (absent, or without a group top-k: none)."""
    experts = a.int("--num-experts")
    if experts in (None, 0):  # validate_args: --num-experts 0 is None
        return {}
    if experts < 2:
        raise SpecError(f"{a.path}:{a.line('--num-experts')}: --num-experts {experts}: plan3d models 2 or more experts")
    num_layers = a.int("--num-layers")
    moe_ffn = a.count("--moe-ffn-hidden-size", ffn)
    shared = a.count("--moe-shared-expert-intermediate-size")
    gate = a.has("--moe-shared-expert-gate")
    if gate and shared is None:
        notes.append("--moe-shared-expert-gate without a shared expert: Megatron ignores it")
        gate = False
    router_dtype = a.get("--moe-router-dtype")
    if router_dtype == "fp64":
        notes.append("--moe-router-dtype fp64: the router's logits modelled in fp32")
    capacity = a.float("--moe-expert-capacity-factor", -1.0)
    if unpadded_capacity(a):
        # plan3d's capacity_factor is drop-and-pad (each expert's input exactly its capacity): memory at capacity, a
        # bound for dropping without padding; the time model leaves out the host sync such a run keeps (Megatron's
        # dispatcher syncs unless drop_and_pad, core_v0.16.1 moe/token_dispatcher.py)
        notes.append(f"--moe-expert-capacity-factor {capacity:g} without --moe-pad-expert-input-to-capacity: read as "
                     "padded to capacity (memory at capacity, an upper bound); the step time leaves out the per-layer "
                     "host sync an unpadded run keeps")
    if a.has("--moe-router-dtype") and router_dtype not in ("fp32", "fp64"):
        raise SpecError(f"{a.path}:{a.line('--moe-router-dtype')}: --moe-router-dtype {router_dtype}: not fp32 or fp64")
    # group-limited routing (TransformerConfig.moe_router_group_topk needs moe_router_num_groups; one group is no limit)
    groups, group_topk = a.count("--moe-router-num-groups"), a.count("--moe-router-group-topk")
    routing = {}
    if group_topk and groups is None:
        raise SpecError(f"{a.path}:{a.line('--moe-router-group-topk')}: --moe-router-group-topk without "
                        "--moe-router-num-groups: Megatron refuses it ('moe_router_num_groups must be specified')")
    if group_topk and groups and groups > 1:
        routing = {"router_num_groups": groups, "router_group_topk": group_topk}
    return {"num_experts": experts, "top_k": a.count("--moe-router-topk", 2),
            "moe_ffn_hidden_size": None if moe_ffn == ffn else moe_ffn,
            "shared_expert_ffn_hidden_size": shared, "shared_expert_gate": gate,
            **moe_layers(a, num_layers), "router_bias": linear_bias,
            "router_dtype": "fp32" if router_dtype in ("fp32", "fp64") else "bf16",
            "capacity_factor": capacity if capacity > 0 else None, **routing}


def deepspeed_optimizer_notes(training: dict, plan: dict) -> list[str]:
    """What DeepSpeed's engine holds for the optimizer it picks (planner.frameworks.deepspeed.wrapper_for), as
    ``plan3d check`` notes."""
    from planner.frameworks.deepspeed import runs_pipeline_engine, wrapper_for

    ds = training.get("deepspeed", {})
    accum, zero = ds.get("grad_accum_dtype"), plan["zero_stage"]
    wrapper = wrapper_for(training["precision"], training["fp16"], accum,
                          runs_pipeline_engine(ds.get("pipeline_engine"), plan["pp"]), zero)
    notes = []
    model_dtype = "fp16" if training["fp16"] else "bf16"
    if zero == 0 and accum not in (None, model_dtype) and training["precision"] != "fp32":
        notes.append(f"DeepSpeed 0.19.8 refuses ZeRO stage 0 with {model_dtype} weights and data_types.grad_accum_dtype "
                     f"{accum} (engine.py _do_optimizer_sanity_check: NotImplementedError)"
                     + ("; earlier releases ran BF16_Optimizer, counted here" if accum == "fp32" else ""))
    if wrapper == "bf16_optimizer":
        notes.append(f"DeepSpeed at ZeRO stage {zero} runs BF16_Optimizer here: the fp32 master weights and optimizer "
                     "states sharded over the data-parallel ranks, a full-size gradient accumulation buffer next to "
                     "the bf16 gradients (bf16_optimizer.py): 2 + 2 + 4 + 12/dp B per parameter"
                     + ("" if accum == "bf16" else ", the buffer counted in fp32 (the dtype DeepSpeed used before "
                        "deepspeedai/DeepSpeed#7790 when the config names none)"))
    elif wrapper == "fp16_optimizer" and not training["fp16"]:
        notes.append("DeepSpeed bf16 at ZeRO stage 0 without its pipeline engine runs FP16_Optimizer in bf16 "
                     "(0.19.8 engine.py: DDP_BFLOAT16; deepspeedai/DeepSpeed#7790): whole fp32 master weights and "
                     "optimizer states, 2 + 2 + 4 + 12 B per parameter; releases before it ran BF16_Optimizer, "
                     "which holds less")
    return notes


def grads_16bit(a: Args) -> bool:
    """Whether Megatron keeps and reduces the gradients in 16 bits (``TrainingSpec.grad_reduce_in_bf16``):
    core_v0.16.1 ``arguments.py`` ``validate_args`` turns ``accumulate_allreduce_grads_in_fp32`` on for ``--bf16``
    unless ``--grad-reduce-in-bf16`` (or ``--main-grads-dtype bf16``), leaves it off for ``--fp16`` unless given,
    and ``training.py`` passes it to DDP as ``grad_reduce_in_fp32``. Under ``--deepspeed`` DeepSpeed's engine holds
    the gradients (``planner/frameworks/deepspeed.py``): the flag alone."""
    if a.has("--deepspeed"):
        return a.has("--grad-reduce-in-bf16")  # without its config; with one, deepspeed_comm_16bit decides
    if a.has("--fp16") and not a.has("--bf16"):
        return not a.has("--accumulate-allreduce-grads-in-fp32")
    return a.has("--bf16") and (a.has("--grad-reduce-in-bf16") or a.get("--main-grads-dtype") == "bf16")


#: DeepSpeed's names for each dtype (0.19.8 runtime/config.py DtypeEnum), as plan3d's DeepSpeedZero spells them
DEEPSPEED_DTYPES = {**dict.fromkeys(("torch.float16", "fp16", "float16", "half"), "fp16"),
                    **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), "fp32"),
                    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), "bf16")}


def deepspeed_zero_settings(a: Args, ds_config: dict) -> tuple[dict, bool]:
    """(``TrainingSpec.deepspeed``, ``overlap_comm``) from a DeepSpeed config, read as DeepSpeed's pydantic config
    classes read it (0.19.8 ``runtime/zero/config.py`` ``DeepSpeedZeroConfig``, ``runtime/config_utils.py``
    ``DeepSpeedConfigModel``): a key set to ``"auto"`` is dropped (the default stands), booleans and integers are
    pydantic's lax ones (``"yes"``, ``0``; ``5e8``), and the defaults are ``contiguous_gradients`` true,
    ``reduce_bucket_size`` 5e8 (> 0), ``stage3_prefetch_bucket_size`` 5e7, ``stage3_max_live_parameters`` and
    ``stage3_max_reuse_distance`` 1e9, ``stage3_param_persistence_threshold`` 1e5 (each >= 0; also under the field
    names without ``stage3_``), ``overlap_comm`` true at stage 3 only; ``data_types.grad_accum_dtype`` takes
    ``DtypeEnum``'s names. What DeepSpeed refuses is a one-line error (tests/test_deepspeed_engine.py parses the
    same sections with DeepSpeed's class)."""
    from pydantic import TypeAdapter, ValidationError

    zero = {k: v for k, v in _section(ds_config, "zero_optimization", a).items() if v != "auto"}

    def lax(key: str, kind: type, default, minimum: int | None = None, alias: str | None = None):
        raw = zero.get(key, zero.get(alias, default) if alias else default)
        if raw is None:
            return default
        try:
            value = TypeAdapter(kind).validate_python(raw)
        except ValidationError:
            value = None
        if value is None or (minimum is not None and value < minimum):
            want = f"an integer >= {minimum}" if minimum is not None else "true or false"
            raise SpecError(f"{a.path}: DeepSpeed config zero_optimization.{key}: {raw!r} is not {want} "
                            "(DeepSpeed refuses it)")
        return value

    stage = zero.get("stage", 0)
    accum = _section(ds_config, "data_types", a).get("grad_accum_dtype")
    if accum is not None and (not isinstance(accum, str) or accum not in DEEPSPEED_DTYPES):
        raise SpecError(f"{a.path}: DeepSpeed config data_types.grad_accum_dtype: {accum!r} is not one of fp32, "
                        "fp16, bf16")
    settings = {"grad_accum_dtype": DEEPSPEED_DTYPES[accum] if accum is not None else None,
                "contiguous_gradients": lax("contiguous_gradients", bool, True),
                "reduce_bucket_elements": lax("reduce_bucket_size", int, 500_000_000, 1),
                "prefetch_bucket_elements": lax("stage3_prefetch_bucket_size", int, 50_000_000, 0,
                                                "prefetch_bucket_size"),
                "max_live_elements": lax("stage3_max_live_parameters", int, 1_000_000_000, 0, "max_live_parameters"),
                "max_reuse_elements": lax("stage3_max_reuse_distance", int, 1_000_000_000, 0, "max_reuse_distance"),
                "persistence_threshold_elements": lax("stage3_param_persistence_threshold", int, 100_000, 0,
                                                      "param_persistence_threshold")}
    return settings, lax("overlap_comm", bool, stage == 3)


def deepspeed_comm_16bit(a: Args, ds_config: dict) -> bool:
    """Whether DeepSpeed reduces the gradients in 16 bits (``TrainingSpec.grad_reduce_in_bf16``, which for DeepSpeed sets
    only the bytes each reduction moves: its gradient buffers are sized in planner/frameworks/deepspeed.py). The
    config's ``communication_data_type`` (fp32, fp16 or bf16, ``runtime/config.py`` ``get_communication_data_type``;
    anything else DeepSpeed refuses); absent, the engine's default: fp16 under ``fp16.enabled``, bf16 under
    ``bf16.enabled``, else fp32 (0.19.8 ``runtime/engine.py`` ``communication_data_type``). ``plan3d emit deepspeed``
    writes the key (planner/emit/deepspeed.py)."""
    value = ds_config.get("communication_data_type")
    if value is None:
        return bool(_section(ds_config, "fp16", a).get("enabled") is True
                    or _section(ds_config, "bf16", a).get("enabled") is True)
    if not isinstance(value, str) or value.lower() not in ("fp32", "fp16", "bf16"):
        raise SpecError(f"{a.path}: DeepSpeed config communication_data_type: '{value}' is not one of fp32, fp16, bf16 "
                        "(DeepSpeed refuses it)")
    return value.lower() != "fp32"


def zero_stage(a: Args, ds_config: dict | None) -> int:
    """ZeRO stage: DeepSpeed's config under --deepspeed; Megatron's distributed optimizer is stage 1;
    Megatron FSDP by its sharding strategy (--data-parallel-sharding-strategy)."""
    if a.has("--deepspeed"):
        if ds_config is not None:
            stage = _section(ds_config, "zero_optimization", a).get("stage", 0)
            if stage not in (0, 1, 2, 3):
                raise SpecError(f"{a.path}: DeepSpeed config zero_optimization.stage {stage!r}: not 0, 1, 2 or 3")
            return stage  # stage 0 with bf16: BF16_Optimizer, the deepspeed profile's ZeRO 0 (frameworks/deepspeed.py)
        return a.int("--zero-stage", 0)
    if a.has("--use-megatron-fsdp") or a.has("--use-torch-fsdp2"):
        if a.has("--use-torch-fsdp2"):
            # --torch-fsdp2-no-reshard-after-forward (core_v0.16.1 training.py: TorchFullyShardedDataParallelConfig
            # reshard_after_forward=False): the gathered weights stay whole from the forward through the backward,
            # as ZeRO 2 holds them (states and gradients sharded), not freed layer by layer as ZeRO 3 frees them
            return 2 if a.has("--torch-fsdp2-no-reshard-after-forward") else 3
        strategy = a.get("--data-parallel-sharding-strategy", "no_shard")
        return {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(strategy, 0)
    return 1 if a.has("--use-distributed-optimizer") else 0


def recompute_modules(a: Args) -> tuple[str, ...]:
    """``--recompute-modules`` (core_v0.16.1 ``TransformerConfig.recompute_modules``, nargs "*", default
    ``core_attn``; what each recomputes: ``planner.memory.apply_recompute_modules``). ``--moe-layer-recompute``
    (deprecated) adds ``moe``, as ``TransformerConfig.__post_init__`` does."""
    from planner.specs import RECOMPUTE_MODULES

    value = a.get("--recompute-modules") if a.has("--recompute-modules") else ["core_attn"]
    modules = [value] if isinstance(value, str) else list(value or [])
    bad = [m for m in modules if m not in RECOMPUTE_MODULES]
    if bad:  # TransformerConfig.__post_init__: "Invalid choices for recompute_modules"
        raise SpecError(f"{a.path}:{a.line('--recompute-modules')}: --recompute-modules: '{bad[0]}' is not one of "
                        f"{', '.join(RECOMPUTE_MODULES)} (Megatron refuses it)")
    if a.has("--moe-layer-recompute") and "moe" not in modules:
        modules.append("moe")
    return tuple(modules)


def _megatron_core_recompute_rules(a: Args, granularity: str | None) -> None:
    """Megatron-Core's own refusals of a recompute setting, raised before the model is built
    (core_v0.16.1 ``TransformerConfig.__post_init__``): full granularity needs ``--recompute-method``
    (block or uniform) and ``--recompute-num-layers``; selective granularity refuses ``--recompute-num-layers``.
    A launch that breaks one never trains, so ``check`` refuses it (exit 2) instead of reading a plan from it.
    Megatron-DeepSpeed launches (``--deepspeed``) are not Megatron-Core's config and are left alone."""
    where = f"{a.path}:{a.line('--recompute-granularity')}"
    if granularity == "full" and a.get("--recompute-method") is None:
        raise SpecError(f"{where}: --recompute-granularity full without --recompute-method: Megatron-Core "
                        "refuses it (recompute_method must be \"block\" or \"uniform\"); add --recompute-method "
                        "uniform --recompute-num-layers 1 to recompute every layer")
    if granularity == "full" and not a.has("--recompute-num-layers"):
        raise SpecError(f"{where}: --recompute-granularity full without --recompute-num-layers: Megatron-Core "
                        "refuses it; add --recompute-num-layers (1 with uniform recomputes every layer)")
    if granularity == "selective" and a.has("--recompute-num-layers"):
        raise SpecError(f"{a.path}:{a.line('--recompute-num-layers')}: --recompute-num-layers with selective "
                        "recompute: Megatron-Core refuses it (recompute_num_layers must be None); drop it")


def dispatcher(a: Args, notes: list[str]) -> str:
    """The MoE token dispatcher plan3d costs for a Megatron launch: ``deepep`` for ``--moe-token-dispatcher-type
    flex`` with DeepEP (``--moe-flex-dispatcher-backend deepep``, Megatron's default backend, or the older
    ``--moe-enable-deepep``); ``allgather`` for ``--moe-token-dispatcher-type allgather`` or none
    (``TransformerConfig.moe_token_dispatcher_type`` defaults to "allgather", core_v0.16.1), which the notes say
    when the flag is absent; ``hybridep`` for the flex dispatcher with ``--moe-flex-dispatcher-backend hybridep``
    (costed as DeepEP's traffic, its own buffer sized: ``memory.hybridep_buffer_bytes``); else the all-to-all.
    Megatron-DeepSpeed launches (``--deepspeed``) and dense models keep the default all-to-all."""
    kind = a.get("--moe-token-dispatcher-type")
    if a.has("--deepspeed") or not a.int("--num-experts"):
        return "alltoall"
    if kind in (None, "allgather"):
        if kind is None:
            notes.append("no --moe-token-dispatcher-type: Megatron-Core's default allgather dispatcher "
                         "(tokens gathered over the etp x ep group)")
        return "allgather"
    if kind != "flex":
        return "alltoall"
    if a.get("--moe-flex-dispatcher-backend") == "hybridep":
        return "hybridep"
    return "deepep"


def fp8_recipe(a: Args, precision: str, notes: list[str]) -> str:
    """``TrainingSpec.fp8_recipe`` of an fp8 launch: ``--fp8-recipe tensorwise`` (Transformer Engine's
    Float8CurrentScaling), ``blockwise`` (Float8BlockScaling) or delayed scaling (``--fp8-recipe delayed``, Megatron-LM
    core_v0.16.1's default). Megatron's ``custom`` recipe (a user's quantizer factory) is not modelled: read as
    current scaling (``tensorwise``), with a note. Like it, it keeps no delayed scaling's amax history, and Megatron's
    checks that single out delayed scaling (core_v0.16.1 ``TransformerConfig.__post_init__``: "Delayed scaling does
    not support moe_act and layernorm recompute") do not apply to it; read as delayed, such a launch was refused for
    a rule it does not break."""
    recipe = a.get("--fp8-recipe")
    if precision != "fp8" or a.has("--deepspeed"):
        return "delayed"
    if recipe in ("tensorwise", "blockwise"):
        return recipe
    if recipe not in (None, "delayed"):
        notes.append(f"--fp8-recipe {recipe}: not modelled; its casts are costed as current scaling's (tensorwise)")
        return "tensorwise"
    return "delayed"


def recompute(a: Args, layers_per_chunk: int, notes: list[str]) -> tuple[str, int | None, int | None]:
    """(``Plan.recompute``, ``Plan.recompute_num_layers``, ``Plan.recompute_group_layers``) of the launch.
    ``--recompute-method block --recompute-num-layers K`` recomputes the first K layers of each model chunk
    (core_v0.16.1 ``transformer_block.py`` ``_checkpointed_forward``): K below the chunk's layers is Megatron's
    block method, modelled as it runs. ``--recompute-method uniform --recompute-num-layers N`` checkpoints groups
    of N layers and recomputes each group whole, holding N layers' activations in the backward: with N > 1,
    ``recompute_group_layers``. Under ``--deepspeed`` both are modelled as no recompute, an upper bound: that
    profile has neither."""
    granularity = a.get("--recompute-granularity")
    if a.has("--moe-layer-recompute") and granularity == "full":  # TransformerConfig.__post_init__
        raise SpecError(f"{a.path}:{a.line('--moe-layer-recompute')}: --moe-layer-recompute with "
                        "--recompute-granularity full: Megatron refuses it; drop one")
    if a.has("--recompute-activations") or a.has("--moe-layer-recompute"):
        granularity = "selective"
    if not a.has("--deepspeed"):
        _megatron_core_recompute_rules(a, granularity)
    if a.has("--checkpoint-activations") or a.has("--deepspeed-activation-checkpointing"):
        granularity = "full"  # Megatron-DeepSpeed / Megatron-LM before 2022: every layer
    n = a.int("--recompute-num-layers", 1)
    if granularity == "full" and a.get("--recompute-method") == "block" and n < layers_per_chunk:
        if not a.has("--deepspeed"):
            return "full", n, None
        notes.append(f"--recompute-method block recomputes {n} of {layers_per_chunk} layers per stage: "
                     "modelled as no recompute, an upper bound (the deepspeed profile has no block method)")
        return "none", None, None
    if granularity == "full" and a.get("--recompute-method") == "uniform" and min(n, layers_per_chunk) > 1:
        if not a.has("--deepspeed"):
            return "full", None, n
        notes.append(f"--recompute-method uniform --recompute-num-layers {n} recomputes {min(n, layers_per_chunk)} "
                     "layers at once: modelled as no recompute, an upper bound (the deepspeed profile recomputes "
                     "layer by layer)")
        return "none", None, None
    return granularity or "none", None, None


# CUDA-graph scopes whose saving plan3d's time model knows (TrainingSpec.cuda_graph_modules, planner.cost.moe_host_s),
# and every one Megatron-LM core_v0.16.1 takes (core/transformer/enums.py CudaGraphScope)
MODELLED_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess", "moe")
GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def cuda_graphs(a: Args, notes: list[str]) -> tuple[str, ...]:
    """The per-layer parts Megatron captures in CUDA graphs that plan3d costs (``TrainingSpec.cuda_graph_modules``),
    read as Megatron-LM core_v0.16.1 reads them, with notes for what plan3d leaves out.

    ``--cuda-graph-impl`` none (default), local or transformer_engine (``TransformerConfig.cuda_graph_impl``); the
    deprecated ``--enable-cuda-graph`` means local and ``--external-cuda-graph`` transformer_engine, and neither may
    be given with ``--cuda-graph-impl`` (``arguments.py`` ``validate_args``: "Do not use --enable-cuda-graph or
    --external-cuda-graph with --cuda-graph-impl"). ``--cuda-graph-scope`` lists the captured parts; none means the
    whole layer, and full_iteration the whole step (local only). ``plan3d emit megatron`` writes transformer_engine
    with the scopes of ``cuda_graph_modules`` (planner/emit/megatron.py ``cuda_graph_flags``), so the round trip
    keeps them. The graphs' own memory (static input and output buffers, the graph memory pool, which Megatron's
    ``cuda_graph_use_single_mempool`` docstring calls "cudagraph memory overheads") is not counted: a note says so.
    """
    legacy = [f for f in ("--enable-cuda-graph", "--external-cuda-graph") if a.has(f)]
    impl = a.get("--cuda-graph-impl", "none")
    impl = impl[0] if isinstance(impl, list) and impl else impl
    if legacy and impl != "none":
        raise SpecError(f"{a.path}:{a.line(legacy[0])}: {legacy[0]} with --cuda-graph-impl {impl}: Megatron asserts "
                        "'Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl'; keep one")
    if len(legacy) == 2:
        raise SpecError(f"{a.path}:{a.line(legacy[0])}: --enable-cuda-graph and --external-cuda-graph cannot be "
                        "enabled at the same time (Megatron asserts it); keep one")
    if legacy:
        impl = "local" if legacy[0] == "--enable-cuda-graph" else "transformer_engine"
    if impl not in ("none", "local", "transformer_engine"):
        raise SpecError(f"{a.path}:{a.line('--cuda-graph-impl')}: --cuda-graph-impl {impl}: Megatron-LM core_v0.16.1 "
                        "takes none, local or transformer_engine")
    if impl == "none":
        return ()
    scopes = a.get("--cuda-graph-scope", [])
    scopes = [str(x) for x in (scopes if isinstance(scopes, list) else [scopes])]
    unpadded = unpadded_capacity(a)
    if "moe" in scopes and unpadded:  # read as padded by moe_fields: Megatron's own rule
        raise SpecError(f"{a.path}:{a.line('--cuda-graph-scope')}: --cuda-graph-scope moe with a capacity factor but "
                        "without --moe-pad-expert-input-to-capacity: Megatron asserts 'moe cuda graph is only "
                        "supported with drop-padding MoE'; add the padding or capture moe_router")
    if "moe_preprocess" in scopes and a.get("--moe-token-dispatcher-type", "allgather") == "alltoall" \
            and (unpadded or a.has("--moe-router-padding-for-fp8")):  # core_v0.16.1 TransformerConfig.__post_init__
        why = "a capacity factor without padding" if unpadded else "--moe-router-padding-for-fp8"
        raise SpecError(f"{a.path}:{a.line('--cuda-graph-scope')}: --cuda-graph-scope moe_preprocess with the alltoall "
                        f"dispatcher and {why}: Megatron asserts 'moe_preprocess cuda graph is not supported when there "
                        "are DtoH copies and synchronizations in the preprocess step'; drop moe_preprocess")
    scopes = [] if scopes == ["full"] else scopes  # validate_args: "full" is the whole layer
    unknown = [x for x in scopes if x not in GRAPH_SCOPES]
    if unknown:  # argparse's type, CudaGraphScope[scope], raises on them
        raise SpecError(f"{a.path}:{a.line('--cuda-graph-scope')}: --cuda-graph-scope {unknown[0]}: Megatron-LM "
                        f"core_v0.16.1 takes {', '.join(GRAPH_SCOPES)}")
    where = f"--cuda-graph-impl {impl}" + (f" --cuda-graph-scope {' '.join(scopes)}" if scopes else "")
    notes.append(f"CUDA graphs ({where}): their static input/output buffers and graph memory pool are not counted "
                 "in memory; keep headroom for them")
    modelled = tuple(x for x in scopes if x in MODELLED_GRAPH_SCOPES) if impl == "transformer_engine" else ()
    rest = [x for x in scopes if x not in modelled] or ([] if scopes else ["the whole layer"])
    if rest:
        notes.append(f"CUDA graphs: {', '.join(rest)} costed with eager kernel launches (plan3d models the launch "
                     f"saving of {', '.join(MODELLED_GRAPH_SCOPES)} under transformer_engine only)")
    return modelled


def _layout(a: Args, pp: int) -> tuple[tuple[int, ...], int] | None:
    """(layers per stage, vpp) of ``--pipeline-model-parallel-layout``, as ``planner.emit.megatron.layout_layers``
    reads Megatron's layout string (core_v0.16.1 ``pipeline_parallel_layer_layout.py``)."""
    if not a.has("--pipeline-model-parallel-layout"):
        return None
    from planner.emit.megatron import layout_layers

    return layout_layers(str(a.get("--pipeline-model-parallel-layout")), pp)


def layers_per_stage(a: Args, layers: int, pp: int) -> list[int] | None:
    layout = _layout(a, pp)
    if layout is not None:
        return list(layout[0])
    emb, loss = a.has("--account-for-embedding-in-pipeline-split"), a.has("--account-for-loss-in-pipeline-split")
    if pp > 1 and (emb or loss):
        # Megatron core_v0.16.1 (transformer_config.py, transformer_block.py::get_num_layers_to_build): the
        # embedding and/or the loss each take one layer's slot; the slots split evenly over the ranks, and rank 0
        # (the last rank) builds one layer fewer, in its first (last) virtual stage (specs.chunk_split's order)
        slots = layers + emb + loss
        if slots % pp:
            raise SpecError(f"{a.path}:{a.line('--account-for-embedding-in-pipeline-split', '--account-for-loss-in-pipeline-split')}: "
                            f"{layers} layers + the embedding/loss slots = {slots} do not split evenly over pp {pp}")
        out = [slots // pp] * pp
        out[0] -= emb
        out[-1] -= loss
        return out
    method = str(a.get("--pp-partition-method", "type:transformer")).lower().replace("embedding|transformer",
                                                                                    "transformer|embedding")
    if pp > 1 and a.has("--deepspeed") and method in ("type:transformer", "type:transformer|embedding"):
        # Megatron-DeepSpeed's pipeline: DeepSpeed's PipelineModule balances the layers whose class matches the
        # pattern (deepspeed/runtime/pipe/module.py _partition_layers, partition_balanced): the L
        # ParallelTransformerLayerPipe, and with "|embedding" (BLOOM) the two tied EmbeddingPipe, first and last.
        # Megatron-DeepSpeed's GPTModelPipe defaults to type:transformer when --pp-partition-method is not given
        # (megatron/model/gpt_model.py); planner.frameworks.deepspeed.pipeline_partitions computes both
        from planner.frameworks.deepspeed import pipeline_partitions

        split = pipeline_partitions(layers, pp).get(method)
        if split is None:
            raise SpecError(f"{a.path}: --pp-partition-method {method}: DeepSpeed would leave a pipeline stage of "
                            f"pp {pp} without a transformer layer for {layers} layers, which its pipeline refuses; "
                            "choose a smaller pp")
        return None if len(set(split)) == 1 else list(split)
    first, last = a.int("--decoder-first-pipeline-num-layers"), a.int("--decoder-last-pipeline-num-layers")
    if pp == 1 or (first is None and last is None):
        return None
    ends = [x for x in (first, last) if x is not None]
    rest, others = layers - sum(ends), pp - len(ends)
    if others == 0:
        return [first, last]
    if rest % others:
        raise SpecError(f"{a.path}:{a.line('--decoder-first-pipeline-num-layers', '--decoder-last-pipeline-num-layers')}: "
                        f"{rest} remaining layers do not split evenly over {others} stages")
    middle = [rest // others] * others
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


def scenario_dicts(a: Args, gpus: int, vocab_override: int | None, ds_config: dict | None,
                   name: str, file_notes: dict | None = None) -> tuple[dict, dict, dict, list[str]]:
    """(model, training, plan) dicts and notes for one Megatron launch on ``gpus`` GPUs."""
    notes: list[str] = []
    if a.has("--rampup-batch-size") and a.has("--train-iters"):
        # core_v0.16.1 arguments.py validate_args, iteration-based training (Megatron-DeepSpeed has the same assert)
        raise SpecError(f"{a.path}:{a.line('--rampup-batch-size')}: --rampup-batch-size with --train-iters: Megatron "
                        "asserts 'expected no batch-size rampup for iteration-based training' and does not start; "
                        "train by samples (--train-samples) or drop the ramp-up")
    if a.has("--encoder-seq-length"):  # core_v0.16.1 validate_args: the older name of --seq-length
        if a.has("--seq-length"):
            raise SpecError(f"{a.path}:{a.line('--encoder-seq-length')}: --encoder-seq-length with --seq-length: "
                            "Megatron asserts encoder_seq_length is None when seq_length is given; keep one")
        a.values["--seq-length"] = a.values["--encoder-seq-length"]
        a.lines["--seq-length"] = a.line("--encoder-seq-length")
    for flag in ("--seq-length", "--micro-batch-size"):
        if not a.has(flag) and not (flag == "--micro-batch-size" and ds_config and
                                    "train_micro_batch_size_per_gpu" in ds_config):
            raise SpecError(f"{a.path}:{a.line0}: no {flag}: Megatron-LM needs it")
    tp, pp, cp = (a.count(x, 1) for x in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                          "--context-parallel-size"))
    if a.has("--no-pipeline-parallel") and pp > 1:
        raise SpecError(f"{a.path}:{a.line('--no-pipeline-parallel')}: --no-pipeline-parallel with pp {pp}")
    model = model_dict(a, tp, vocab_override, notes, name, file_notes)
    if gpus % (tp * pp * cp):
        raise SpecError(f"{a.path}:{a.line('--tensor-model-parallel-size')}: {gpus} GPUs are not divisible by "
                        f"tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp} (Megatron refuses to start); launch a "
                        f"multiple of {tp * pp * cp} GPUs (--nnodes/--nproc_per_node) or pass --gpus N to plan3d check")
    dp = gpus // (tp * pp * cp)
    mbs, gbs = a.count("--micro-batch-size"), a.count("--global-batch-size")
    if a.has("--fp4-format"):  # Transformer Engine NVFP4BlockScaling (--fp4-recipe nvfp4, the default)
        precision = "nvfp4"
    elif a.has("--fp8-format") and a.get("--fp8-recipe") == "mxfp8":  # TE MXFP8BlockScaling
        precision = "mxfp8"
    elif a.has("--fp8-format") or a.has("--fp8-e4m3") or a.has("--fp8-hybrid"):  # the last two: Megatron-LM 2023
        precision = "fp8"
    elif a.has("--bf16") or a.has("--fp16"):
        precision = "bf16"
    else:
        precision = "fp32"
        notes.append("no --bf16/--fp16/--fp8-format: Megatron trains in fp32")
    if a.has("--fp16"):
        notes.append("--fp16: modelled as bf16 (same 2 bytes per value)")
    if ds_config is not None:
        mbs, gbs, precision = _deepspeed_batch(a, ds_config, mbs, gbs, dp, precision)
    if gbs is None:
        gbs = mbs * dp
    # fp16, not bf16: DeepSpeed's ZeRO-0 then runs FP16_Optimizer, whole fp32 master and Adam states
    # (planner/frameworks/deepspeed.py); the DeepSpeed config decides where there is one
    fp16 = a.has("--fp16") and not a.has("--bf16")
    if ds_config is not None and (_section(ds_config, "fp16", a).get("enabled") is True
                                  or _section(ds_config, "bf16", a).get("enabled") is True):
        fp16 = _section(ds_config, "fp16", a).get("enabled") is True
    sp = a.has("--sequence-parallel")
    if sp and tp == 1:
        sp = False
        notes.append("--sequence-parallel with tp 1: Megatron turns it off")
    vpp = 1
    slots = model["num_layers"] + a.has("--account-for-embedding-in-pipeline-split") + \
        a.has("--account-for-loss-in-pipeline-split")
    per_chunk_layers = slots // pp
    if a.has("--num-layers-per-virtual-pipeline-stage"):
        per_chunk = a.count("--num-layers-per-virtual-pipeline-stage")
        vpp = max(1, per_chunk_layers // per_chunk) if per_chunk else 1
        per_chunk_layers = per_chunk or per_chunk_layers
    elif a.has("--num-virtual-stages-per-pipeline-rank"):
        vpp = a.count("--num-virtual-stages-per-pipeline-rank")
        per_chunk_layers = per_chunk_layers // max(vpp, 1)
    elif _layout(a, pp) is not None:
        vpp = _layout(a, pp)[1]
        per_chunk_layers = max(1, per_chunk_layers // vpp)
    if a.has("--deepspeed") and (pp > 1 or not a.has("--no-pipeline-parallel")) and zero_stage(a, ds_config) >= 2:
        # without --no-pipeline-parallel Megatron-DeepSpeed builds a PipelineModule even on one stage
        raise SpecError(f"{a.path}:{a.line('--deepspeed')}: DeepSpeed's pipeline engine refuses ZeRO stage 2 or 3 "
                        "(deepspeed/runtime/pipe/engine.py), and Megatron-DeepSpeed runs it unless "
                        "--no-pipeline-parallel; use stage 0/1, or pp 1 with --no-pipeline-parallel")
    flash_flags = ("--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton")
    if a.has("--deepspeed"):  # Megatron-DeepSpeed's attention is unfused unless a flash flag is given
        # (the flash-attn package, or its Triton kernel: FlashAttention-2's speed at best)
        attention = "flash2" if any(a.has(f) for f in flash_flags) else "materialized"
    else:
        # --attention-backend (emit.megatron.ATTENTION_BACKENDS): flash forces the flash-attn package (FlashAttention-2's
        # speed), fused and auto (the default) Transformer Engine's fastest, cuDNN on Hopper and later
        backend = a.get("--attention-backend")
        attention = "materialized" if backend in ("unfused", "local") else "flash2" if backend == "flash" else "flash"
        if a.get("--transformer-impl") == "local":
            attention = local_impl_attention(a, precision, notes)
    ds_settings = deepspeed_zero_settings(a, ds_config) if a.has("--deepspeed") and ds_config is not None else None
    if ds_settings is not None:
        # Megatron-DeepSpeed's pretrain_gpt.py builds GPTModelPipe (a PipelineModule, so DeepSpeed's PipelineEngine)
        # unless --no-pipeline-parallel, whatever the stage count
        ds_settings[0]["pipeline_engine"] = not a.has("--no-pipeline-parallel")
    training = {"num_gpus": gpus, "global_batch_size": gbs, "seq_len": a.int("--seq-length"),
                "precision": precision, "attention": attention, "fp8_recipe": fp8_recipe(a, precision, notes),
                # a Megatron-DeepSpeed launch runs DeepSpeed's engine: its ZeRO stages, BF16_Optimizer, buckets and
                # pipeline partitions (planner/frameworks/deepspeed.py)
                "framework": "deepspeed" if a.has("--deepspeed") else "megatron",
                # under --deepspeed the engine overlaps as its config's overlap_comm says (deepspeed_zero_settings)
                "overlap_grad_reduce": a.has("--overlap-grad-reduce") if ds_settings is None else ds_settings[1],
                "fp16": fp16, **({"deepspeed": ds_settings[0]} if ds_settings is not None else {}),
                "grad_reduce_in_bf16": deepspeed_comm_16bit(a, ds_config) if a.has("--deepspeed") and ds_config is not None
                else grads_16bit(a),
                # each full-recompute checkpoint keeps 1/tp of its input (memory.saved_bytes_per_layer_kind); under
                # --deepspeed the checkpoints are DeepSpeed's, partitioned with --partition-activations (Megatron-
                # DeepSpeed hands the flag to deepspeed.checkpointing.configure under
                # --deepspeed-activation-checkpointing)
                "distribute_saved_activations": (a.has("--distribute-saved-activations") and not a.has("--deepspeed"))
                or (a.has("--deepspeed") and a.has("--deepspeed-activation-checkpointing")
                    and a.has("--partition-activations")),
                # Megatron-Core's Muon (TrainingSpec.optimizer; --optimizer sgd is read as adam: fewer states)
                "optimizer": a.get("--optimizer") if not a.has("--deepspeed") and a.get("--optimizer") in (
                    "muon", "dist_muon") else "adam",
                # the precision-aware optimizer with bf16 moments (planner/frameworks/megatron.py); other moment or
                # master dtypes are smaller than fp32 Adam's and are read as fp32, the larger
                "optimizer_dtype": "bf16" if (not a.has("--deepspeed") and a.has("--use-precision-aware-optimizer")
                                              and a.get("--exp-avg-dtype") == "bf16"
                                              and a.get("--exp-avg-sq-dtype") == "bf16") else "fp32",
                # the loss kernel (TrainingSpec.cross_entropy_fusion); Megatron-DeepSpeed has no such flags
                "cross_entropy_fusion": "none" if a.has("--deepspeed") or not a.has("--cross-entropy-loss-fusion")
                else ("te" if a.get("--cross-entropy-fusion-impl") == "te" else "native"),
                # fp8 / mxfp8 weights with no bf16 copy (planner/frameworks/megatron.py)
                "fp8_params": precision in ("fp8", "mxfp8") and not a.has("--deepspeed") and a.has("--fp8-param-gather"),
                # absent flags leave the framework's default (planner.cost.framework_defaults)
                "tp_comm_overlap": True if a.has("--tp-comm-overlap") else None,
                "overlap_p2p_comm": False if a.has("--no-overlap-p2p-communication") else None,
                # the MoE all-to-all overlap: one more warm-up forward and a merged step's layer in memory
                # (memory.a2a_overlap_extra_layers), where Megatron runs it (memory.a2a_overlap_active)
                "moe_a2a_overlap": not a.has("--deepspeed") and a.has("--overlap-moe-expert-parallel-comm"),
                # DeepEP: the flex dispatcher with its default backend (TransformerConfig core_v0.16.1:
                # moe_flex_dispatcher_backend "deepep"), as plan3d emits it, or HybridEP; their buffers and group
                # rules follow
                "moe_token_dispatcher": dispatcher(a, notes),
                # TEGroupedMLP only with --moe-grouped-gemm (TransformerConfig.moe_grouped_gemm = False, core_v0.16.1);
                # else SequentialMLP (frameworks.expert_gemm_streams)
                "moe_grouped_gemm": a.has("--deepspeed") or not a.int("--num-experts") or a.has("--moe-grouped-gemm"),
                # the captured parts whose launches plan3d costs as one (cuda_graphs; their memory is noted, not counted)
                "cuda_graph_modules": () if a.has("--deepspeed") else cuda_graphs(a, notes),
                # Megatron-LM's s x s bool mask per micro-batch on the first and last stage, on unless turned off
                # (TrainingSpec.attention_mask_in_dataloader, memory.dataloader_mask_bytes)
                "attention_mask_in_dataloader": not a.has("--deepspeed")
                and not a.has("--no-create-attention-mask-in-dataloader"),
                # the eager SwiGLU saves two more f/tp-wide tensors (TrainingSpec.unfused_swiglu); TE's activation
                # function (--use-te-activation-func) is taken before it (core_v0.16.1 mlp.py)
                "unfused_swiglu": not a.has("--deepspeed") and a.has("--swiglu") and a.has("--no-bias-swiglu-fusion")
                and not a.has("--use-te-activation-func"),
                # layers outside the FP8/FP4 context (TrainingSpec.bf16_layers_at_start/end): core_v0.16.1
                # TransformerConfig num_layers_at_start_in_bf16 / _at_end_in_bf16, 1 and 1 by default; inert in bf16
                **({"bf16_layers_at_start": max(0, a.int("--num-layers-at-start-in-bf16", 1)),
                    "bf16_layers_at_end": max(0, a.int("--num-layers-at-end-in-bf16", 1))}
                   if a.has("--first-last-layers-bf16") and precision in ("fp8", "mxfp8", "nvfp4")
                   and not a.has("--deepspeed") else {}),
                # the output layer's deferred weight gradients (TrainingSpec.defer_embedding_wgrad)
                "defer_embedding_wgrad": not a.has("--deepspeed") and a.has("--defer-embedding-wgrad-compute"),
                "wgrad_deferral_limit": max(0, a.int("--wgrad-deferral-limit", 0))}
    if training["defer_embedding_wgrad"] and a.has("--no-gradient-accumulation-fusion"):
        raise SpecError(f"{a.path}:{a.line('--defer-embedding-wgrad-compute')}: --defer-embedding-wgrad-compute with "
                        "--no-gradient-accumulation-fusion: Megatron-Core refuses it ('Cannot defer embedding wgrad "
                        "compute when gradient accumulation fusion is not used'); drop one of them")
    if training["attention_mask_in_dataloader"]:
        seq = training["seq_len"]
        mask_mib = mbs * (seq // cp) * seq / 2**20
        notes.append(f"no --no-create-attention-mask-in-dataloader: Megatron-LM puts a {mbs} x 1 x {seq // cp} x "
                     f"{seq} bool attention mask ({mask_mib:,.0f} MiB) on the first and the last pipeline stage for "
                     "each micro-batch's forward, counted; TE's causal attention does not read it, and the flag "
                     "removes it")
    comm_types = a.get("--cp-comm-type", ["p2p"])
    comm_types = comm_types if isinstance(comm_types, list) else [comm_types]
    if cp > 1 and not a.has("--deepspeed") and any(str(x) != "p2p" for x in comm_types):
        # TransformerConfig.cp_comm_type: p2p (default), all_gather, a2a, a2a+p2p; plan3d models the p2p ring only
        # (planner.cost.ring_attention, memory.cp_ring_transient_bytes)
        notes.append(f"--cp-comm-type {' '.join(map(str, comm_types))}: context parallelism costed and sized as "
                     "the p2p ring (Megatron's default), the only one plan3d models")
    if ds_config is not None and a.has("--deepspeed"):
        deepspeed_refusals(a, ds_config)
    notes += optimizer_notes(a, ds_config if a.has("--deepspeed") else None)
    if a.has("--fine-grained-activation-offloading") and not a.has("--deepspeed"):
        # core_v0.16.1 TransformerConfig.fine_grained_activation_offloading: the --offload-modules' saved inputs go to
        # host memory; plan3d holds them on the GPU (the larger figure)
        notes.append("--fine-grained-activation-offloading: the offloaded modules' activations counted in GPU "
                     "memory: an upper bound")
    rc, rc_layers, rc_group = recompute(a, per_chunk_layers, notes)
    plan = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "vpp": vpp, "micro_batch_size": mbs,
            # absent --expert-tensor-parallel-size: tp (validate_args), the plan's None
            "ep": a.count("--expert-model-parallel-size", 1), "etp": a.count("--expert-tensor-parallel-size"),
            "recompute": rc, "recompute_num_layers": rc_layers, "recompute_group_layers": rc_group, "sequence_parallel": sp,
            # validate_args turns offloading on only for a count > 0 (core_v0.16.1 arguments.py line 1236)
            "cpu_offload_layers": max(0, a.int("--cpu-offloading-num-layers", 0)),
            "zero_stage": zero_stage(a, ds_config),
            "layers_per_stage": layers_per_stage(a, model["num_layers"], pp),
            "microbatch_group_size": (a.count("--microbatch-group-size-per-virtual-pipeline-stage")
                                      if a.has("--microbatch-group-size-per-virtual-pipeline-stage") and vpp > 1
                                      else None)}
    if ds_settings is not None:
        notes += deepspeed_optimizer_notes(training, plan)
    elif a.has("--num-distributed-optimizer-instances") and not a.has("--deepspeed"):  # Megatron-LM's flag only
        instances = a.count("--num-distributed-optimizer-instances", 1)
        if instances > 1 and plan["zero_stage"] == 1:  # TrainingSpec.dist_optimizer_instances; plan_problems checks it
            training["dist_optimizer_instances"] = instances
        elif instances > 1 and plan["zero_stage"] == 0:  # core_v0.16.1 distributed_data_parallel.py asserts it
            raise SpecError(f"{a.path}:{a.line('--num-distributed-optimizer-instances')}: "
                            f"--num-distributed-optimizer-instances {instances} without --use-distributed-optimizer: "
                            "Megatron-Core refuses it ('Partial DistOpt cannot be used without DistOpt'); add "
                            "--use-distributed-optimizer or drop it")
        elif instances > 1:
            raise SpecError(f"{a.path}:{a.line('--num-distributed-optimizer-instances')}: "
                            f"--num-distributed-optimizer-instances {instances} with Megatron-FSDP (hybrid sharding) is "
                            "not modelled: plan3d would count the states sharded over all dp x cp ranks, so the file is "
                            "refused")
    if plan["recompute"] == "selective" and not a.has("--deepspeed"):  # Megatron-Core checks them only then
        training["recompute_modules"] = recompute_modules(a)
    return model, training, plan, notes


def optimizer_notes(a: Args, ds_config: dict | None = None) -> list[str]:
    """What a launch's optimizer changes that plan3d counts as Adam on the GPU, each an upper bound: SGD keeps one
    fp32 momentum per parameter where Adam keeps two (core_v0.16.1 ``optimizer/__init__.py``: torch's ``SGD`` with
    ``momentum``; Megatron-DeepSpeed's ``--optimizer sgd`` the same), and Megatron's ``--optimizer-cpu-offload`` keeps
    (``--optimizer-offload-fraction``, default 1) of the fp32 states in host memory (``optimizer/cpu_offloading``).
    A DeepSpeed config's ``optimizer`` replaces the launch's (0.19.8 ``engine.py`` ``_configure_basic_optimizer``):
    Adagrad, Lion and SGD keep one state at most; Adam, AdamW, LAMB and muP's Adam keep Adam's two; anything else is
    refused (:func:`deepspeed_refusals`)."""
    ds_name = _deepspeed_optimizer(a, ds_config)
    if ds_name is not None:
        if ds_name in DEEPSPEED_ONE_STATE_OPTIMIZERS:
            return [f"DeepSpeed optimizer {ds_name}: at most one fp32 state counted as Adam's two moments (4 B per "
                    "parameter more): an upper bound"]
        return []
    notes = []
    if a.get("--optimizer") == "sgd":
        notes.append("--optimizer sgd: its one fp32 momentum counted as Adam's two moments (4 B per parameter more): "
                     "an upper bound")
    if a.has("--optimizer-cpu-offload") and not a.has("--deepspeed"):
        notes.append("--optimizer-cpu-offload: the optimizer states counted in GPU memory: an upper bound")
    return notes


# DeepSpeed 0.19.8 optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS, lower-cased; others are torch.optim classes
# by name, engine.py _configure_basic_optimizer), by the fp32 states each keeps per parameter
DEEPSPEED_ADAM_LIKE_OPTIMIZERS = ("adam", "adamw", "lamb", "muadam", "muadamw")  # exp_avg and exp_avg_sq
DEEPSPEED_ONE_STATE_OPTIMIZERS = ("adagrad", "lion", "musgd", "sgd")  # state_sum / exp_avg / momentum_buffer
# DeepSpeed 0.19.8 runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS and _REMOVED_ZERO_CONFIG_KEYS: the config class
# raises DeepSpeedConfigError on each (deepspeedai/DeepSpeed#8489), so the engine never starts
DEEPSPEED_REMOVED_KEYS = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                          "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
                          "progressive_layer_drop")
DEEPSPEED_REMOVED_ZERO_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


def _deepspeed_optimizer(a: Args, ds_config: dict | None) -> str | None:
    """The DeepSpeed config's optimizer name as the engine resolves it (lower-cased when it is one of DeepSpeed's
    own, ``runtime/config.py``; a torch.optim class otherwise, matched here without case), or None without one."""
    if ds_config is None:
        return None
    opt = _section(ds_config, "optimizer", a)
    name = opt.get("type")
    if name is None:
        return None
    if not isinstance(name, str):
        raise SpecError(f"{a.path}: DeepSpeed config optimizer.type: {name!r} is not an optimizer name")
    return name.lower()


def deepspeed_refusals(a: Args, ds_config: dict) -> None:
    """What keeps plan3d from judging a DeepSpeed config, as one-line errors: the keys DeepSpeed 0.19.8 itself refuses
    (``DEEPSPEED_REMOVED_KEYS``), ZeRO++'s secondary weight partition (``zero_hpz_partition_size`` > 1 at stage 3:
    a second copy of the 16-bit weights sharded within the node, ``runtime/zero/partition_parameters.py``, which plan3d
    does not count) and an optimizer whose states plan3d does not know (Muon, a torch.optim class other than SGD)."""
    for key in DEEPSPEED_REMOVED_KEYS:
        if key in ds_config:
            raise SpecError(f"{a.path}: DeepSpeed config {key}: removed from DeepSpeed (0.19.8 refuses the config, "
                            "deepspeedai/DeepSpeed#8489); drop it")
    zero = _section(ds_config, "zero_optimization", a)
    for key in DEEPSPEED_REMOVED_ZERO_KEYS:
        if key in zero:
            raise SpecError(f"{a.path}: DeepSpeed config zero_optimization.{key}: removed from DeepSpeed (0.19.8 "
                            "refuses the config, deepspeedai/DeepSpeed#8489); drop it")
    hpz = zero.get("zero_hpz_partition_size", 1)
    if zero.get("stage") == 3 and isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1:
        raise SpecError(f"{a.path}: DeepSpeed config zero_optimization.zero_hpz_partition_size {hpz}: ZeRO++'s "
                        "secondary weight partition is not modelled: plan3d would under-count the weights each GPU "
                        "holds, so the file is refused")
    name = _deepspeed_optimizer(a, ds_config)
    if name is not None and name not in DEEPSPEED_ADAM_LIKE_OPTIMIZERS + DEEPSPEED_ONE_STATE_OPTIMIZERS:
        raise SpecError(f"{a.path}: DeepSpeed config optimizer.type {ds_config['optimizer']['type']}: its states are "
                        "not modelled (plan3d counts Adam's two, or fewer for Adagrad, Lion and SGD), so the file "
                        "is refused")


def local_impl_attention(a: Args, precision: str, notes: list[str]) -> str:
    """The attention of a ``--transformer-impl local`` launch (Transformer Engine's modules left out). Megatron-Core's
    local layer spec takes its core attention from ``LocalSpecProvider.core_attention``: ``DotProductAttention``,
    which materialises the s x s scores and saves its softmax (core_v0.16.1 ``models/backends.py``,
    ``transformer/dot_product_attention.py``), whatever ``--attention-backend`` says. The legacy model
    (``--use-legacy-models``) runs ``CoreAttention``, the same, unless ``--use-flash-attn`` (the flash-attn package,
    FlashAttention-2; ``legacy/model/transformer.py`` ``ParallelAttention``). FP8 needs Transformer Engine's modules
    ("required for fp8 training", ``gpt_layer_specs.py``), which the local spec has none of: refused."""
    if precision in ("fp8", "mxfp8", "nvfp4"):
        raise SpecError(f"{a.path}:{a.line('--transformer-impl')}: --transformer-impl local with {precision}: the "
                        "local modules have no FP8/FP4 GEMMs (Transformer Engine's are required, gpt_layer_specs.py); "
                        "drop the low-precision flags or use --transformer-impl transformer_engine")
    if a.has("--use-legacy-models") and a.has("--use-flash-attn"):
        notes.append("--transformer-impl local with --use-legacy-models --use-flash-attn: FlashAttention-2")
        return "flash2"
    notes.append("--transformer-impl local: attention materialises its s x s scores (Megatron's DotProductAttention)")
    return "materialized"


def _deepspeed_batch(a: Args, ds: dict, mbs, gbs, dp: int, precision: str):
    """Batch sizes and precision from a DeepSpeed config, checked against the Megatron flags (DeepSpeed
    asserts train_batch_size = micro x accumulation x dp, deepspeed/runtime/config.py)."""
    ds_mbs, ds_gbs = ds.get("train_micro_batch_size_per_gpu"), ds.get("train_batch_size")
    gas = ds.get("gradient_accumulation_steps")
    for key, value in (("train_micro_batch_size_per_gpu", ds_mbs), ("train_batch_size", ds_gbs),
                       ("gradient_accumulation_steps", gas)):
        if value is not None and not isinstance(value, int):
            raise SpecError(f"{a.path}: DeepSpeed config {key}: '{value}' is not an integer")
    if ds_mbs is not None and mbs is not None and ds_mbs != mbs:
        raise SpecError(f"{a.path}:{a.line('--micro-batch-size')}: --micro-batch-size {mbs} but the DeepSpeed config "
                        f"says train_micro_batch_size_per_gpu {ds_mbs}; make them agree")
    mbs = mbs if mbs is not None else ds_mbs
    if ds_gbs is None and ds_mbs is not None and gas is not None:
        ds_gbs = ds_mbs * gas * dp
    if ds_gbs is not None and gbs is not None and ds_gbs != gbs:
        raise SpecError(f"{a.path}:{a.line('--global-batch-size')}: --global-batch-size {gbs} but the DeepSpeed "
                        f"config gives train_batch_size {ds_gbs}; make them agree")
    gbs = gbs if gbs is not None else ds_gbs
    if _section(ds, "fp16", a).get("enabled") is True or _section(ds, "bf16", a).get("enabled") is True:
        precision = precision if precision == "fp8" else "bf16"
    zero = _section(ds, "zero_optimization", a)
    for key in ("offload_optimizer", "offload_param"):
        device = _section(zero, key, a).get("device", "none")
        if device not in (None, "none"):
            raise SpecError(f"{a.path}: DeepSpeed config zero_optimization.{key}.device {device}: CPU/NVMe offload "
                            "is not modelled")
    return mbs, gbs, precision


def _section(doc: dict, key: str, a: Args) -> dict:
    value = doc.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{a.path}: DeepSpeed config {key}: expected an object, got {value!r}")
    return value
