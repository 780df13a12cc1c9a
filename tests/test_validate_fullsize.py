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
