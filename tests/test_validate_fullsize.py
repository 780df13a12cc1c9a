"""Issue 15, full-size path: a rank builds only its own chunks, on the meta device, and materialises only
its shards after TP and FSDP2 have cut them (torchtitan's order). One CPU process plays rank 0 of a
64-GPU job (TP 8 x FSDP 8) through torch's fake process group, for Llama-3-70B at full width with 4
layers: the full chunk would be 22 GB in fp32, which this process never allocates."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from planner.fake_rank import fake_world  # noqa: E402
from planner.presets import load_model  # noqa: E402
from planner.validate.model import build_local_chunks, materialize_local, tensor_parallelize  # noqa: E402


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read the resident set")
def test_a_70b_rank_allocates_its_shard_only():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = load_model("llama3-70b").model_copy(update={"num_layers": 4})
    tp, dp = 8, 8
    with fake_world(tp * dp):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        (chunk,) = build_local_chunks(model, [4], pp=1, pp_rank=0)
        full_params = sum(p.numel() for p in chunk.parameters())
        assert all(p.is_meta for p in chunk.parameters())
        tensor_parallelize(chunk, mesh["tp"], sequence_parallel=True)
        for blk in chunk.layers:
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(chunk, mesh=mesh["dp"])
        before = _rss_bytes()
        materialize_local([chunk], "cpu")
        grown = _rss_bytes() - before
        local = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in chunk.parameters()]
        local_bytes = sum(t.numel() * t.element_size() for t in local)
    full_bytes = full_params * 4
    assert not any(t.is_meta for t in local)
    assert local_bytes == pytest.approx(full_bytes / (tp * dp), rel=0.02)  # the shard, padding aside
    assert grown < 1.5 * local_bytes + 256 * 2**20  # the shard and allocator slack, nothing like the chunk
    assert full_bytes > 40 * grown  # 22 GB of chunk, a few hundred MB resident
    # initialised as build_chunks does: matrices N(0, 0.02), norm weights 1
    w = chunk.layers[0].feed_forward.w1.weight
    w = w._local_tensor if hasattr(w, "_local_tensor") else w
    assert 0.015 < float(w.float().std()) < 0.025
    n = chunk.layers[0].attention_norm.weight
    assert float((n._local_tensor if hasattr(n, "_local_tensor") else n).float().mean()) == 1.0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read the resident set")
def test_a_70b_rank_in_bf16_keeps_fp32_shards_and_computes_in_bf16():
    """The same rank with the policy a bf16 plan runs under (worker.mp_policy: FSDP2
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's defaults): materialising
    allocates the fp32 shards only; the parameters FSDP2 holds are those fp32 shards; a gathered layer is bf16
    at its TP-local size, and the layer computes in bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planner.validate.launch import run_precision
    from planner.validate.worker import mp_policy

    model = load_model("llama3-70b").model_copy(update={"num_layers": 4})
    tp, dp = 8, 8
    mp = mp_policy(run_precision("bf16"))
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mp_policy(run_precision("fp8")) == mp  # an fp8 plan runs the same bf16 policy (launch.run_precision)
    with fake_world(tp * dp):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        (chunk,) = build_local_chunks(model, [4], pp=1, pp_rank=0)
        full_params = sum(p.numel() for p in chunk.parameters())
        tensor_parallelize(chunk, mesh["tp"], sequence_parallel=True)
        for blk in chunk.layers:
            fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(chunk, mesh=mesh["dp"], mp_policy=mp)
        before = _rss_bytes()
        materialize_local([chunk], "cpu")
        grown = _rss_bytes() - before
        local = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in chunk.parameters()]
        local_bytes = sum(t.numel() * t.element_size() for t in local)
        assert {t.dtype for t in local} == {torch.float32}  # what AdamW steps: fp32 shards, no bf16 copy at rest
        # 4 B per parameter over tp x dp: the fp32 shard, padding aside (hand count: full_params * 4 / 64)
        assert local_bytes == pytest.approx(full_params * 4 / (tp * dp), rel=0.02)
        assert grown < 1.5 * local_bytes + 256 * 2**20

        chunk._get_fsdp_state()._lazy_init()  # what the first forward of the root does: sets each FSDPParam's dtypes
        blk = chunk.layers[0]
        group = blk._get_fsdp_state()._fsdp_param_group
        assert {(f.orig_dtype, f.param_dtype, f.reduce_dtype) for f in group.fsdp_params} == \
            {(torch.float32, torch.bfloat16, torch.float32)}
        w1 = blk.feed_forward.w1.weight
        tp_local = (model.ffn_size // tp, model.hidden_size)  # ColwiseParallel: the TP shard of [f, h]
        blk.unshard()  # the all-gather over dp (a no-op on the fake group: shapes and dtypes only)
        gathered = blk.feed_forward.w1.weight
        gathered_local = gathered._local_tensor if hasattr(gathered, "_local_tensor") else gathered
        assert gathered_local.dtype == torch.bfloat16 and tuple(gathered_local.shape) == tp_local
        blk.reshard()
        assert blk.feed_forward.w1.weight is w1  # resharded: the fp32 shard is the registered parameter again

        seen = {}

        def record(module, args, out):
            seen["w1"] = (args[0].dtype, out.dtype)

        blk.feed_forward.w1.register_forward_hook(record)
        seq = 16  # SP: each TP rank holds seq / tp tokens of the fp32 residual stream; FSDP2 casts it to bf16
        with torch.no_grad():
            out = blk(torch.zeros(1, seq // tp, model.hidden_size))
        out_local = out._local_tensor if hasattr(out, "_local_tensor") else out
        assert out_local.dtype == torch.bfloat16 and tuple(out_local.shape) == (1, seq // tp, model.hidden_size)
        assert seen["w1"] == (torch.bfloat16, torch.bfloat16)
