"""The three input specs (model, hardware, training) and the output plan.

Units and prefixes (one convention, used everywhere):

* memory in GiB (2**30 bytes) in spec fields (``_gib``), bytes (``_bytes``) inside formulas;
* bandwidth in GB/s (10**9 bytes/s) (``_gbps``); compute in TFLOP/s (10**12) (``_tflops``);
* latency in microseconds (``_us``); time in seconds (``_s``).

Conversions to base units happen once, in properties of the spec (``*_bytes``, ``*_flops``,
``*_bytes_per_s``), never inside formulas.

Glossary:

* **layer**: one transformer block (attention + MLP). **stage**: the layers one pipeline rank holds;
  with interleaving (``vpp > 1``) a stage is split into ``vpp`` **chunks** (virtual stages).
* **micro-batch**: ``micro_batch_size`` sequences that go through the pipeline together;
  **global batch**: all sequences of one optimizer step, over all data-parallel replicas.
* **axis**: one parallel dimension (tp, cp, dp, pp); its **degree** is its size.

Short names (``tp``, ``pp``, ``dp``, ``cp``, ``vpp``) are used in all working code; the long
names of a target framework appear only in ``planner/emit``.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 2**30

Activation = Literal["gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
PositionEmbedding = Literal["learned", "rope", "alibi"]
Precision = Literal["bf16", "fp8", "fp32"]
Recompute = Literal["none", "selective", "full"]
AttentionKernel = Literal["flash", "materialized"]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _problems(errors: list[str]) -> None:
    """Raise one ValueError carrying every problem found, one per line."""
    if errors:
        raise ValueError("\n".join(errors))


class ModelSpec(_Spec):
    """A decoder-only transformer (GPT / Llama family), as Megatron-LM builds it."""

    name: str = Field(min_length=1, description="Short name, used in output file names.")
    num_layers: int = Field(ge=1, description="Transformer layers (L).")
    hidden_size: int = Field(ge=1, description="Model width (h).")
    num_attention_heads: int = Field(ge=1, description="Query heads (a).")
    num_kv_heads: int | None = Field(
        default=None, ge=1,
        description="Key/value heads (g). Default: equal to num_attention_heads (MHA); fewer = GQA.")
    head_dim: int | None = Field(
        default=None, ge=1, description="Width of one head (d_h). Default: hidden_size / num_attention_heads.")
    ffn_hidden_size: int | None = Field(
        default=None, ge=1,
        description="MLP intermediate width per branch (f). Default: 4 * hidden_size.")
    vocab_size: int = Field(ge=1, description="Vocabulary size (V), before padding.")
    max_seq_len: int | None = Field(
        default=None, ge=1, description="Longest sequence the model supports; required for learned positions.")
    activation: Activation = Field(default="gelu", description="MLP type: gelu (2 matrices) or swiglu (3).")
    norm: Norm = Field(default="layernorm", description="layernorm (weight + bias) or rmsnorm (weight only).")
    tied_embeddings: bool = Field(default=False, description="Output layer shares the input embedding matrix.")
    position_embedding: PositionEmbedding = Field(
        default="rope", description="learned (max_seq_len x h table), rope or alibi (no parameters).")
    linear_bias: bool = Field(default=False, description="Linear layers carry biases (GPT-2/3 style).")
    qkv_bias: bool | None = Field(
        default=None, description="Bias on the Q/K/V projection only (Qwen2). Default: same as linear_bias.")
    embedding_norm: bool = Field(default=False, description="A norm right after the word embedding (BLOOM).")
    dropout: bool = Field(
        default=False, description="Dropout active in training (stores 1-byte masks); Llama-style models have none.")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        a, g, h = self.num_attention_heads, self.kv_heads, self.hidden_size
        errors = []
        if self.head_dim is None and h % a:
            errors.append(f"hidden_size({h}) is not divisible by num_attention_heads({a}); set head_dim")
        if a % g:
            errors.append(f"num_attention_heads({a}) is not divisible by num_kv_heads({g})")
        if self.position_embedding == "learned" and self.max_seq_len is None:
            errors.append("max_seq_len: required when position_embedding is 'learned'")
        _problems(errors)
        return self

    # --- derived sizes (Megatron names in comments) ---------------------------------------
    @property
    def kv_heads(self) -> int:
        """g: key/value heads (Megatron ``num_query_groups``)."""
        return self.num_kv_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """d_h: width of one head (Megatron ``kv_channels``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """a * d_h: query projection width (Megatron ``query_projection_size``)."""
        return self.num_attention_heads * self.kv_channels

    @property
    def ffn_size(self) -> int:
        """f: MLP intermediate width per branch."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def has_qkv_bias(self) -> bool:
        return self.linear_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: 2h for LayerNorm (gamma, beta), h for RMSNorm."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden_size

    def layer_params(self) -> int:
        """Parameters of one transformer layer.

        Source: formulas.md A2 [code] Megatron-LM ``theoretical_memory_usage.py``: attention
        ``h*q + 2*h*g*d_h + q*h``, MLP ``2*h*f`` (GeLU) or ``3*h*f`` (SwiGLU), two norms; biases
        [derived]: QKV ``q + 2*g*d_h``, O ``h``, FC1 ``f`` (``2f`` SwiGLU), FC2 ``h``.
        """
        h, f, q = self.hidden_size, self.ffn_size, self.q_size
        kv = 2 * self.kv_heads * self.kv_channels
        mlp_in = 2 * f if self.activation == "swiglu" else f
        attention = h * (q + kv) + q * h  # QKV + output projection
        mlp = h * mlp_in + f * h  # FC1 (gate+up for SwiGLU) + FC2
        norms = 2 * self.norm_params  # pre-attention and pre-MLP norms
        bias = (q + kv if self.has_qkv_bias else 0) + ((h + mlp_in + h) if self.linear_bias else 0)
        return attention + mlp + norms + bias

    def embedding_params(self, vocab_size: int | None = None) -> int:
        """Input-side parameters: word embedding, learned positions, embedding norm."""
        v = vocab_size or self.vocab_size
        h = self.hidden_size
        positions = self.max_seq_len * h if self.position_embedding == "learned" else 0
        return v * h + positions + (self.norm_params if self.embedding_norm else 0)

    def output_params(self, vocab_size: int | None = None) -> int:
        """Output-side parameters: final norm and (untied) LM head."""
        v = vocab_size or self.vocab_size
        return self.norm_params + (0 if self.tied_embeddings else v * self.hidden_size)

    @property
    def num_params(self) -> int:
        """Exact parameter count (formulas.md A2), embeddings included, tied head counted once."""
        return self.num_layers * self.layer_params() + self.embedding_params() + self.output_params()


class HardwareSpec(_Spec):
    """One kind of GPU node and the network between nodes.

    Bandwidths are *achievable* nccl-tests bus bandwidths per GPU (formulas.md C1, C5), not line
    rates: the cost model divides bytes-on-the-wire by them directly.
    """

    name: str = Field(min_length=1, description="Short name of the profile.")
    gpu_memory_gib: float = Field(gt=0, description="Device memory per GPU as the runtime reports it, GiB.")
    peak_bf16_tflops: float = Field(gt=0, description="Dense (non-sparse) BF16 tensor-core peak, TFLOP/s.")
    peak_fp8_tflops: float | None = Field(
        default=None, gt=0, description="Dense FP8 peak, TFLOP/s; absent when the GPU has no FP8 units.")
    peak_fp32_tflops: float | None = Field(
        default=None, gt=0, description="Dense FP32 (TF32 tensor-core on GPUs) peak, TFLOP/s; for fp32 training.")
    hbm_bandwidth_gbps: float = Field(gt=0, description="Peak HBM bandwidth, GB/s.")
    gpus_per_node: int = Field(ge=1, description="GPUs sharing the fast intra-node fabric (NVLink domain).")
    intra_node_bandwidth_gbps: float = Field(
        gt=0, description="Achievable ring bus bandwidth per GPU inside a node (nccl-tests busbw), GB/s.")
    intra_node_latency_us: float = Field(ge=0, description="Per-step latency of an intra-node collective, us.")
    inter_node_bandwidth_gbps: float = Field(
        gt=0, description="Achievable ring bus bandwidth per GPU across nodes (NICs x rate / GPUs), GB/s.")
    inter_node_latency_us: float = Field(ge=0, description="Per-step latency of an inter-node collective, us.")
    cuda_context_gib: float = Field(default=0.5, ge=0, description="CUDA context and kernels per process, GiB.")
    nccl_buffers_gib: float = Field(default=1.5, ge=0, description="NCCL communicator buffers per process, GiB.")
    fragmentation_headroom: float = Field(
        default=0.05, ge=0, lt=1, description="Fraction of memory kept free for allocator fragmentation.")
    gemm_efficiency_max: float = Field(
        default=0.8, gt=0, le=1,
        description="Maximum achievable matmul FLOP/s over the dense peak (MAMF: best shape, measured).")
    sustained_fraction: float = Field(
        default=1.0, gt=0, le=1,
        description="Fraction of the burst (MAMF) compute rate a GPU holds through a long training run: "
                    "power-capped clocks and kernel gaps. Calibrated, see docs/cost-model.md.")
    sm_count: int = Field(
        default=108, ge=1, description="Streaming multiprocessors (compute units): sets GEMM wave quantisation.")
    nccl_channels: int = Field(
        default=16, ge=0,
        description="SMs a running NCCL collective occupies (one thread block per channel): compute that "
                    "overlaps communication loses this share of the GPU.")
    kernel_overhead_us: float = Field(
        default=5.0, ge=0, description="Fixed cost per GEMM kernel (launch, prologue, epilogue), us.")
    attention_efficiency: float = Field(
        default=0.5, gt=0, le=1,
        description="Achieved fraction of peak in the fused (flash) attention forward kernel.")
    hbm_efficiency: float = Field(
        default=0.7, gt=0, le=1, description="Achieved fraction of HBM bandwidth in memory-bound kernels.")

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB

    @property
    def usable_memory_gib(self) -> float:
        """Capacity minus fixed overheads and fragmentation headroom (formulas.md A6)."""
        return self.gpu_memory_gib * (1 - self.fragmentation_headroom) - self.cuda_context_gib - self.nccl_buffers_gib

    def peak_flops(self, precision: Precision) -> float:
        """Dense peak in FLOP/s for the training precision."""
        tflops = {"fp8": self.peak_fp8_tflops, "fp32": self.peak_fp32_tflops}.get(precision, self.peak_bf16_tflops)
        if tflops is None:
            raise ValueError(f"precision: {self.name} has no {precision} peak (peak_{precision}_tflops); use bf16")
        return tflops * 1e12


class TrainingSpec(_Spec):
    """What one optimizer step processes."""

    num_gpus: int = Field(ge=1, description="GPUs in the job (world size).")
    global_batch_size: int = Field(ge=1, description="Sequences per optimizer step, over all replicas.")
    seq_len: int = Field(ge=1, description="Tokens per sequence.")
    precision: Precision = Field(
        default="bf16", description="bf16 or fp8 mixed precision (Megatron), or fp32 (the CPU validate run).")
    attention: AttentionKernel = Field(
        default="flash",
        description="flash: fused attention that stores no s x s scores (Dao et al. 2022); "
                    "materialized: the scores and softmax are stored, as in Korthikanti et al. 2022.")
    framework: Literal["megatron", "nemo", "torchtitan", "deepspeed", "torch"] = Field(
        default="megatron",
        description="The framework that runs the plan: sets how weights, gradients, optimizer states and "
                    "logits are held (planner/frameworks) and what the search may propose. megatron "
                    "(Megatron-Core), nemo (NeMo on Megatron-Core), torchtitan (FSDP2, DTensor, torch "
                    "pipelining), deepspeed (ZeRO engine, Megatron-DeepSpeed); torch: torchtitan's "
                    "torch.distributed semantics with plan3d validate's fused kernels.")
    overlap_grad_reduce: bool = Field(
        default=True,
        description="Overlap the data-parallel gradient reduction with the last micro-batch's backward "
                    "(Megatron --overlap-grad-reduce, since 2023; Megatron-LM 2021 did not).")
    grad_reduce_in_bf16: bool = Field(
        default=False,
        description="Keep and reduce gradients in 16 bits (Megatron --grad-reduce-in-bf16; fp16 training "
                    "in 2021); default fp32 main grads.")


class Plan(_Spec):
    """How a job is split: the output of `plan3d search`, the input of estimate/emit/check/validate."""

    tp: int = Field(ge=1, description="Tensor-parallel degree; 1 = off.")
    pp: int = Field(ge=1, description="Pipeline-parallel degree (stages); 1 = off.")
    dp: int = Field(ge=1, description="Data-parallel degree (replicas); 1 = off.")
    cp: int = Field(default=1, ge=1, description="Context-parallel degree; 1 = off.")
    vpp: int = Field(default=1, ge=1, description="Virtual stages (chunks) per pipeline rank; 1 = plain 1F1B.")
    micro_batch_size: int = Field(ge=1, description="Sequences per micro-batch.")
    num_microbatches: int | None = Field(
        default=None, ge=1,
        description="Micro-batches per step per pipeline; derived as global_batch / (micro_batch_size * dp).")
    recompute: Recompute = Field(
        default="none", description="Activation recomputation: none, selective (attention core) or full (layer).")
    sequence_parallel: bool = Field(default=False, description="Megatron sequence parallelism (needs tp > 1).")
    zero_stage: int = Field(
        default=0, ge=0, le=3,
        description="Optimizer sharding over DP: 0 none, 1 optimizer states (Megatron distributed optimizer), "
                    "2 + gradients, 3 + weights (FSDP).")
    layers_per_stage: tuple[int, ...] | None = Field(
        default=None, description="Layers on each pipeline stage, for uneven pipelines; default: even split.")

    @model_validator(mode="after")
    def _check(self) -> Plan:
        errors = []
        if self.sequence_parallel and self.tp == 1:
            errors.append("sequence_parallel: needs tp > 1 (tp is 1); drop --sequence-parallel or raise tp")
        if self.vpp > 1 and self.pp == 1:
            errors.append(f"vpp: vpp({self.vpp}) > 1 needs pp > 1 (pp is 1)")
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp:
            errors.append(f"layers_per_stage: {len(self.layers_per_stage)} entries for pp({self.pp}) stages")
        if self.layers_per_stage is not None and min(self.layers_per_stage, default=1) < 1:
            errors.append(f"layers_per_stage: every stage needs at least 1 layer, got {list(self.layers_per_stage)}")
        _problems(errors)
        return self

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage: the explicit list, or an even split."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return (num_layers // self.pp,) * self.pp

    def label(self) -> str:
        """Short identifier used in file names, e.g. ``tp8-pp4-dp16_mbs1``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"dp{self.dp}"]
        return "-".join(parts) + f"_mbs{self.micro_batch_size}"


def job_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec) -> list[str]:
    """What is wrong with the job whatever the plan: sequence too long, fp8 without fp8 units."""
    errors = []
    if model.max_seq_len is not None and training.seq_len > model.max_seq_len:
        errors.append(f"seq_len: {training.seq_len} > max_seq_len({model.max_seq_len}) of {model.name}")
    if training.precision != "bf16" and getattr(hardware, f"peak_{training.precision}_tflops") is None:
        errors.append(f"precision: {hardware.name} has no {training.precision} peak "
                      f"(peak_{training.precision}_tflops); use bf16")
    from planner.frameworks import get as framework_profile

    return errors + framework_profile(training.framework).job_problems(training.precision)


def plan_problems(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, plan: Plan) -> list[str]:
    """Every way ``plan`` does not fit ``model`` and ``training``, one line each, naming the field."""
    t, p, d, c, v = plan.tp, plan.pp, plan.dp, plan.cp, plan.vpp
    L, a, g = model.num_layers, model.num_attention_heads, model.kv_heads
    B, b, s = training.global_batch_size, plan.micro_batch_size, training.seq_len
    errors = []
    if plan.world_size != training.num_gpus:
        errors.append(f"plan: tp({t}) * pp({p}) * dp({d}) * cp({c}) = {plan.world_size} != num_gpus({training.num_gpus})")
    if B % (b * d):
        errors.append(f"global_batch_size: {B} is not divisible by micro_batch_size({b}) * dp({d}) = {b * d}")
    elif plan.num_microbatches is not None and plan.num_microbatches != B // (b * d):
        errors.append(f"num_microbatches: {plan.num_microbatches} != global_batch_size({B}) / "
                      f"(micro_batch_size({b}) * dp({d})) = {B // (b * d)}")
    if a % t:
        errors.append(f"tp: num_attention_heads({a}) is not divisible by tp({t})")
    if g % t and t % g:
        errors.append(f"tp: num_kv_heads({g}) is not divisible by tp({t}), nor tp by num_kv_heads to replicate them")
    if model.ffn_size % t:
        errors.append(f"tp: ffn_hidden_size({model.ffn_size}) is not divisible by tp({t})")
    if plan.layers_per_stage is None and L % (p * v):
        errors.append(f"pp: num_layers({L}) is not divisible by pp({p}) * vpp({v}) = {p * v}; "
                      "choose other degrees or give layers_per_stage")
    if plan.layers_per_stage is not None:
        if sum(plan.layers_per_stage) != L:
            errors.append(f"layers_per_stage: sum {sum(plan.layers_per_stage)} != num_layers({L})")
        if any(n % v for n in plan.layers_per_stage):
            errors.append(f"layers_per_stage: every stage must split into vpp({v}) chunks, got {list(plan.layers_per_stage)}")
    if c > 1 and s % (2 * c):
        errors.append(f"cp: seq_len({s}) is not divisible by 2 * cp({c}) = {2 * c} (load-balanced causal split)")
    if v > 1 and B % (b * d) == 0 and (B // (b * d)) % p:
        errors.append(f"vpp: the interleaved schedule needs num_microbatches({B // (b * d)}) divisible by pp({p})")
    from planner.frameworks import get as framework_profile

    errors += framework_profile(training.framework).plan_problems(plan)
    return errors + job_problems(model, hardware, training)


class Scenario(_Spec):
    """A complete, consistent job: the specs plus a plan that fits them. This is a plan file."""

    model: ModelSpec
    hardware: HardwareSpec
    training: TrainingSpec
    plan: Plan

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        _problems(plan_problems(self.model, self.hardware, self.training, self.plan))
        return self

    @property
    def num_microbatches(self) -> int:
        """m = B / (b * d) (formulas.md shared symbols)."""
        return self.training.global_batch_size // (self.plan.micro_batch_size * self.plan.dp)

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.plan.stage_layers(self.model.num_layers)

    def resolved_plan(self) -> Plan:
        """The plan with ``num_microbatches`` and ``layers_per_stage`` filled in."""
        return self.plan.model_copy(update={"num_microbatches": self.num_microbatches,
                                            "layers_per_stage": self.stage_layers})


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded as Megatron-LM pads it: to a multiple of ``multiple * tp``.

    Source: Megatron-LM ``megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding``
    (``--make-vocab-size-divisible-by``, default 128).
    """
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)
