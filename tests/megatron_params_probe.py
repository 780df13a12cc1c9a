"""The parameters Megatron-Core (core_v0.16.1, ../shared/consumers) builds on each pipeline rank for the arguments a
plan3d launch file passes, for tests/test_megatron_params.py to compare with planner.memory ``stage_param_split``.

For each case (the words of an emitted ``.megatron.args`` file and the job's world size) it runs Megatron's own
``parse_args``, ``validate_args`` and ``core_transformer_config_from_args`` (with the stand-ins of
tests/test_emit_consumers.py ``megatron_validate``: the GPU's compute capability, also as
``torch.cuda.get_device_capability`` answers it, and TE's fused RoPE kernel), then,
for every pipeline rank r, joins a fake process group (``torch.testing._internal.distributed.fake_pg``) as the global
rank of (tp, cp, ep, dp) = 0 on that pipeline rank (Megatron's default order tp-cp-ep-dp-pp), initialises
``parallel_state`` as ``megatron/training/initialize.py`` does, and builds every model chunk of that rank as
``megatron/training/training.py::get_model`` and Megatron-LM's ``gpt_builders.py::gpt_builder`` do: the block spec
(``get_gpt_decoder_block_spec``, the MTP block spec from the last layer's spec), ``GPTModel`` with
``padded_vocab_size`` as Megatron's ``build_tokenizer`` sets it from the emitted tokenizer arguments, pre/post-process
per virtual stage. It reports per rank the parameters (``nelement``, as get_model prints them) and those of the routed
experts (``allreduce`` False, which DDP puts in the expert-parallel buffers), the optimizer bytes of dist_muon's
fullest rank as Megatron's own ``LayerWiseDistributedOptimizer.shard_params`` deals those parameters (``_muon_dealt``),
and the model FLOPs of a step as Megatron logs them (``megatron/training/training.py::num_floating_point_operations``
on the same arguments).

Stand-ins, beyond ``megatron_validate``'s; none changes a parameter except the first, whose difference the test
takes out by its formula:

* the model is built with Megatron's local (non-Transformer-Engine) layer specs, since TE needs CUDA. They hold TE's
  parameters (TE fuses the norm into the next linear layer, with the same weight), except MLA's two
  down-projections, which the TE spec replicates on every TP rank (``TELinear``, ``parallel_mode="duplicated"``) and
  the local spec splits over TP (``ColumnParallelLinear``; core_v0.16.1 ``gpt_layer_specs.py``);
* the config is built with sequence parallelism, ``persist_layer_norm``, ``memory_efficient_layer_norm`` and
  ``layernorm_zero_centered_gamma`` off (the local spec's torch norm refuses them), ``gradient_accumulation_fusion``
  off (a kernel of Apex's CUDA extension), ``moe_grouped_gemm`` off (the routed experts are then the local
  ``SequentialMLP``, one MLP per local expert, as TE's ``TEGroupedMLP`` keeps one weight per expert) and
  ``perform_initialization`` off (it needs CUDA's RNG tracker, and meta tensors hold no values);
* the local ``DotProductAttention`` (no parameters) is given MLA's ``k_channels`` and ``v_channels``, which only
  TE's takes in core_v0.16.1, and drops them, and is built as if without context parallelism, which it refuses
  (TE's kernel runs CP); ``multi_latent_attention.HAVE_TE`` is set False (its import of Megatron's TE extension
  succeeds without TE installed and leaves ``TELinear`` None, which its ``isinstance`` check then refuses);
* ``torch.cuda.Stream`` makes nothing (the MoE dispatcher's side stream, used only in forward), and
  tests/megatron_stand_ins.py puts what Megatron makes on ``"cuda"`` on the meta device (full-width layers cost no
  memory) and answers ``Tensor.type()`` with the CUDA type name.

Nothing else is changed.

Run as ``python tests/megatron_params_probe.py PORT MEGATRON_ROOT CASES.json`` (PORT, which
tests/subprocess_probe.py passes to every probe, is not used: the process group is fake); prints one JSON line."""

from __future__ import annotations

import json
import os
import sys


def _megatron_args(arguments, rope_utils, words: list[str], world: int, arch: int, fsdp: bool):
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # validate_args sets them per case
        os.environ.pop(var, None)
    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    if fsdp:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    arguments.get_device_arch_version = lambda: arch
    arguments.torch.cuda.get_device_capability = lambda *a, **k: (arch, 0)  # validate_args asks it for grouped GEMMs
    rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None
    if "--fp4-format" in words:
        arguments.is_te_min_version = lambda version, *a, **k: True
    sys.argv = ["pretrain_gpt.py"] + words
    args = arguments.parse_args()
    arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's args_defaults
    return args, arguments.core_transformer_config_from_args(args)


def _build_chunk(args, config, pre_process: bool, post_process: bool, vp_stage):
    """One model chunk as gpt_builders.py::gpt_builder builds it, with the local layer specs (module docstring)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                          get_gpt_layer_local_spec, get_gpt_mtp_block_spec)

    def layer_spec():
        return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        args.multi_latent_attention, normalization=args.normalization)

    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    else:
        spec = layer_spec()
    mtp = None
    if args.mtp_num_layers is not None:
        if hasattr(spec, "layer_specs") and not spec.layer_specs:
            last = layer_spec()
        else:
            last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization,
                                               qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp,
                    vp_stage=vp_stage)


def _muon_dealt(ps, chunks) -> tuple[float, float]:
    """(fullest dense rank, fullest expert rank) of dist_muon's optimizer bytes on this pipeline rank: Megatron's own
    ``LayerWiseDistributedOptimizer.shard_params`` (core_v0.16.1 ``optimizer/layer_wise_optimizer.py``) deals the
    chunks' parameters over this rank's dp x cp and expert-data-parallel groups (it lists every rank's share), in
    parameter groups as ``get_megatron_muon_optimizer`` makes them (Muon's: 2-D and not the embedding or output layer,
    ``muon.py``; Adam's: the rest; each split by ``allreduce`` as ``_get_param_groups`` does); then 8 B per Muon
    parameter (fp32 master and momentum) and 12 B per Adam one. Nothing is stepped: only the dealing is Megatron's."""
    from types import SimpleNamespace

    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    params = [p for c in chunks for p in c.parameters() if p.requires_grad]

    def muon(p) -> bool:
        return p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)

    def groups(keep) -> list[dict]:
        return [{"params": [p for p in params if keep(p) and getattr(p, "allreduce", True) == dense],
                 "is_expert_parallel": not dense} for dense in (True, False)]

    optimizers = [SimpleNamespace(param_groups=groups(muon)), SimpleNamespace(param_groups=groups(lambda p: not muon(p)))]
    layer_wise = LayerWiseDistributedOptimizer.__new__(LayerWiseDistributedOptimizer)
    layer_wise.pg_collection = SimpleNamespace(dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
                                               expt_dp=ps.get_expert_data_parallel_group())
    LayerWiseDistributedOptimizer.shard_params(layer_wise, optimizers)

    def bytes_of(ps_list) -> float:
        return float(sum(p.nelement() * (8 if muon(p) else 12) for p in ps_list))

    expert = [p for p in params if not getattr(p, "allreduce", True)]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    if layer_wise.dp_cp_params_list is None:  # a dp x cp group of one: nothing dealt, the experts neither
        return bytes_of(dense), bytes_of(expert)
    dense_max = max(bytes_of([p for p in r if getattr(p, "allreduce", True)]) for r in layer_wise.dp_cp_params_list)
    if layer_wise.expt_dp_params_list is None:  # one expert-data-parallel rank, or no experts
        return dense_max, bytes_of(expert)
    return dense_max, max(bytes_of(r) for r in layer_wise.expt_dp_params_list)


def _rank_params(torch, ps, args, config, pp_rank: int) -> tuple[int, int, tuple[float, float]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = args.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=pp_rank * (world // args.pipeline_model_parallel_size),
                            world_size=world)
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 args.virtual_pipeline_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                                 order="tp-cp-ep-dp-pp", create_gloo_process_groups=False)
    assert ps.get_pipeline_model_parallel_rank() == pp_rank and ps.get_tensor_model_parallel_rank() == 0
    vpp = args.virtual_pipeline_model_parallel_size
    first, last = pp_rank == 0, pp_rank == args.pipeline_model_parallel_size - 1
    if vpp and args.pipeline_model_parallel_size > 1:
        chunks = [_build_chunk(args, config, first and v == 0, last and v == vpp - 1, v) for v in range(vpp)]
    else:
        chunks = [_build_chunk(args, config, first, last, None)]
    params = [p for c in chunks for p in c.parameters()]
    total = sum(p.nelement() for p in params)
    expert = sum(p.nelement() for p in params if not getattr(p, "allreduce", True))
    muon = _muon_dealt(ps, chunks)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return total, expert, muon


def main(megatron_root: str, cases_path: str) -> dict:
    sys.path.insert(0, megatron_root)
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import megatron.training.arguments as arguments
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.training.tokenizer.tokenizer import build_tokenizer

    from tests.megatron_stand_ins import device_for_cuda

    meta_for_cuda = device_for_cuda(torch, "meta")
    torch.cuda.Stream = lambda *a, **k: None  # MoEAlltoAllTokenDispatcher makes a side stream (used in forward only)

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local_init = DotProductAttention.__init__

    def init(self, config, *a, k_channels=None, v_channels=None, **k):  # MLA's head widths, which TE's kernel takes
        cp, config.context_parallel_size = config.context_parallel_size, 1  # only TE's kernel runs CP
        try:
            local_init(self, config, *a, **k)
        finally:
            config.context_parallel_size = cp
    DotProductAttention.__init__ = init
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False  # its TE import succeeds without TE here and leaves TELinear None (module docstring)
    out = []
    for case in json.loads(open(cases_path).read()):
        args, config = _megatron_args(arguments, rope_utils, case["words"], case["world"], case["arch"], case["fsdp"])
        build_tokenizer(args)  # Megatron's own: the emitted NullTokenizer and --vocab-size set padded_vocab_size
        # the local spec's torch norm refuses these; none changes a parameter (module docstring)
        config.sequence_parallel = config.persist_layer_norm = config.memory_efficient_layer_norm = False
        config.layernorm_zero_centered_gamma = False
        config.gradient_accumulation_fusion = False  # Apex's CUDA extension; a kernel choice, no parameter
        # the local spec's grouped experts need the grouped_gemm package; its SequentialMLP holds the same weights
        args.moe_grouped_gemm = config.moe_grouped_gemm = False
        config.perform_initialization = False  # meta tensors: nothing to initialise (no CUDA RNG tracker here)
        with meta_for_cuda:
            ranks = [_rank_params(torch, ps, args, config, r) for r in range(args.pipeline_model_parallel_size)]
        from megatron.training.training import num_floating_point_operations

        out.append({"name": case["name"], "ranks": [r[:2] for r in ranks], "muon": [r[2] for r in ranks],
                    "padded_vocab_size": args.padded_vocab_size,
                    "flops_per_step": num_floating_point_operations(args, args.global_batch_size)})
    return {"cases": out}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[2], sys.argv[3])))
