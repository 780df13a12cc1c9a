"""The mixture-of-experts layer of the validate model: router, routed experts split over the
expert-parallel group, token dispatch and combine with all-to-all, shared experts.

Built from torch's own pieces, following Megatron-Core's ``MoELayer`` (core_v0.16.1
``megatron/core/transformer/moe/``) and torchtitan's ``AllToAllTokenDispatcher``
(``torchtitan/models/common/token_dispatcher.py``):

* Router: Megatron ``TopKRouter`` with its defaults (``--moe-router-score-function softmax``,
  ``--moe-router-pre-softmax`` off): an ``h x E`` linear layer, the top-k logits of each token,
  then a softmax over those k (``topk_softmax_with_capacity``). No auxiliary loss (Megatron's default
  ``--moe-aux-loss-coeff`` is 0).
* Capacity (``ModelSpec.capacity_factor``, Megatron ``--moe-expert-capacity-factor`` with
  ``--moe-pad-expert-input-to-capacity``, core_v0.16.1 ``moe_utils.apply_router_token_dropping``): each expert takes
  exactly ``C = ceil(T k / E * c)`` of this rank's ``T`` tokens (all ``T`` where ``C > T``), the ``C`` with the
  largest routing probability for it (the "probs" drop policy): copies over capacity are dropped, and tokens that did
  not choose the expert fill its free slots with probability 0 (the padding). The counts are known, so no count
  exchange precedes the token all-to-all. Dropless without one.
* Dispatch (Megatron ``MoEAlltoAllTokenDispatcher``): the k copies of each token are sorted by
  expert, the per-expert counts are exchanged with one all-to-all over the EP group, then the
  tokens themselves with ``torch.distributed._functional_collectives.all_to_all_single_autograd``
  (whose backward is the reverse all-to-all). Each rank runs its ``E/ep`` local experts on the
  tokens every EP peer sent it; combine sends the outputs back the same way, scales them by the
  router probabilities and adds the k copies of each token (``scatter_add``).
* Experts: one MLP of ``moe_ffn_size`` each (gated per the spec: the same ``MLP`` as the dense
  layer, SwiGLU saving only its input as Megatron's fused kernel does). Expert tensor parallelism
  is 1 (the miniature refuses etp > 1). Shared experts: one MLP of their total width, with the
  optional sigmoid gate (:class:`Gate`).
* Tensor parallelism (tp > 1, with sequence parallelism, as Megatron requires for MoE with TP): the layer
  works on this rank's sequence shard. The router and the gate are replicated over TP (their gradients
  summed over it) and the shared experts are column/row parallel, as in Megatron-Core
  (planner.validate.model.tensor_parallelize); the EP group is drawn from the tp x dp ranks.

Parameters keep the reference model's names (``experts.experts.<global index>``), so a rank's local
experts can be compared with the single-process model parameter by parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.specs import ModelSpec
from planner.validate.moe import expert_capacity


class Experts(nn.Module):
    """The routed experts this rank holds (all ``E`` until :meth:`MoE.localize`). A module of its own
    so that FSDP2 can shard it over the expert-data-parallel ranks (torchtitan's EP layout)."""

    def __init__(self, model: ModelSpec):
        super().__init__()
        from planner.validate.model import MLP

        self.experts = nn.ModuleDict({str(i): MLP(model, model.moe_ffn_size) for i in range(model.num_experts)})

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [mlp(x) for mlp, x in zip(self.experts.values(), inputs)]


class Gate(nn.Module):
    """The shared experts' sigmoid gate, ``sigmoid(x . w)`` (Megatron ``--moe-shared-expert-gate``; Qwen2-MoE
    ``shared_expert_gate``, an ``h -> 1`` linear layer without bias). The weight is kept as an ``h`` vector
    so that FSDP2 shards it evenly over dp (a ``1 x h`` matrix would sit whole on one rank)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))

    def forward(self, x):
        return torch.sigmoid(x @ self.weight[:, None])


class MoE(nn.Module):
    def __init__(self, model: ModelSpec):
        super().__init__()
        from planner.validate.model import MLP

        h = model.hidden_size
        self.num_experts, self.top_k = model.num_experts, model.top_k
        self.spec = model  # the routing (validate.moe.expert_capacity); capacity_factor None: dropless
        self.router = nn.Linear(h, model.num_experts, bias=model.router_bias)
        self.experts = Experts(model)
        self.shared = MLP(model, model.shared_expert_ffn_hidden_size) if model.shared_expert_ffn_hidden_size else None
        self.shared_gate = Gate(h) if model.shared_expert_gate else None
        self.ep, self.ep_rank, self.ep_group = 1, 0, None
        self.on_routed = None  # set by the worker: called with the tokens this rank's experts received

    def localize(self, ep_rank: int, ep: int, group) -> None:
        """Keep experts ``ep_rank*E/ep .. (ep_rank+1)*E/ep - 1`` (Megatron's contiguous assignment,
        ``MoELayer.local_expert_indices``) and route over ``group``."""
        per = self.num_experts // ep
        keep = {str(i) for i in range(ep_rank * per, (ep_rank + 1) * per)}
        for name in list(self.experts.experts.keys()):
            if name not in keep:
                del self.experts.experts[name]
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, group

    def forward(self, x):
        b, s, h = x.shape
        k, num_e, ep = self.top_k, self.num_experts, self.ep
        local = num_e // ep
        xt = x.reshape(b * s, h)
        top_logits, idx = self.router(xt).topk(k, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)  # Megatron TopKRouter: softmax over the top-k logits
        if self.spec.capacity_factor is None:
            flat = idx.reshape(-1)
            with torch.no_grad():
                order = torch.argsort(flat, stable=True)  # the k copies of every token, sorted by expert
                token_of = order // k
                counts = torch.bincount(flat, minlength=num_e)
            weights = probs.reshape(-1)[order]
        else:  # drop and pad to capacity (module docstring): C slots per expert, expert-major
            tokens = b * s
            cap = expert_capacity(self.spec, tokens)
            gates = torch.zeros(tokens, num_e, dtype=probs.dtype, device=probs.device).scatter(1, idx, probs)
            with torch.no_grad():
                slots = gates.topk(cap, dim=0).indices  # [C, E]: the C tokens of largest probability per expert
                order = (slots * num_e + torch.arange(num_e, device=slots.device)).t().reshape(-1)
                token_of = order // num_e
                counts = torch.full((num_e,), cap, dtype=torch.long, device=slots.device)
            weights = gates.reshape(-1)[order]
        routed = xt[token_of]
        if self.ep_group is None:
            recv = counts.view(1, num_e)
            received = routed
        else:
            import torch.distributed as dist
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            if self.spec.capacity_factor is None:
                with torch.no_grad():
                    got = torch.empty_like(counts)
                    dist.all_to_all_single(got, counts, group=self.ep_group)  # [peer, local expert] counts
            else:  # every peer sends C per expert: nothing to exchange (Megatron's drop_and_pad skips it too)
                got = counts
            recv = got.view(ep, local)
            send_splits = counts.view(ep, local).sum(1).tolist()
            recv_splits = recv.sum(1).tolist()
            received = all_to_all_single_autograd(routed, recv_splits, send_splits, self.ep_group)
        sizes = recv.tolist()  # sizes[r][j]: tokens of peer r for local expert j, rank-major in ``received``
        pieces = received.split([n for row in sizes for n in row])
        inputs = [torch.cat([pieces[r * local + j] for r in range(len(sizes))]) for j in range(local)]
        if self.on_routed is not None:
            self.on_routed(sum(t.shape[0] for t in inputs))
        outputs = self.experts(inputs)
        back = [out.split([row[j] for row in sizes]) for j, out in enumerate(outputs)]
        returned = torch.cat([back[j][r] for r in range(len(sizes)) for j in range(local)])
        if self.ep_group is not None:
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            returned = all_to_all_single_autograd(returned, send_splits, recv_splits, self.ep_group)
        # scatter_add (Megatron's unpermute, torchtitan's combine) keeps only its index; index_add would keep the source
        out = torch.zeros_like(xt).scatter_add(0, token_of[:, None].expand(-1, h), returned * weights[:, None])
        if self.shared is not None:
            shared = self.shared(xt)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(xt)
            out = out + shared
        return out.view(b, s, h)
