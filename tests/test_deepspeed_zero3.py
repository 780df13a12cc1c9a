"""planner/frameworks/deepspeed_zero3.py (DeepSpeed ZeRO-3's parameter coordinator, ported) against the real
coordinator of deepspeed 0.19.8 (installed by the Makefile), run on this CPU by tests/deepspeed_zero3_probe.py over
the same module trees: the hook calls of a step, and the elements gathered after every fetch of steps 2 and 3."""

import json

import pytest

from planner.frameworks.deepspeed_zero3 import Module, Settings, flatten, gathered_elements, hook_events, replay


class Ids:
    def __init__(self):
        self.n = 0

    def __call__(self, elements):
        self.n += 1
        return (self.n, elements)


def transformer(layers=6, embedding=300, tied=False, experts=0, checkpointed=False):
    """Embedding (+ a parameterless dropout), layers of norm / attention (qkv, parameterless core, out) / norm / MLP
    or experts, final norm, output layer (tied: the embedding's weight again)."""
    p = Ids()
    word = p(embedding)

    def mlp(width):
        return Module((), (Module((p(width), p(4))), Module(()), Module((p(width), p(4)))))

    def layer():
        ffn = Module((p(8),), tuple(mlp(30) for _ in range(experts))) if experts else mlp(120)
        return Module((), (Module((p(4),)), Module((), (Module((p(90), p(6))), Module(()), Module((p(40), p(2))))),
                           Module((p(4),)), ffn), checkpointed=checkpointed)
    body = tuple(layer() for _ in range(layers))
    out = Module((word,)) if tied else Module((p(embedding),))
    return Module((), (Module((), (Module((word,)), Module(()))), *body, Module((p(4),)), out))


def flat():
    p = Ids()
    return Module((), (Module((p(250),)), *[Module((p(100), p(4))) for _ in range(8)], Module((p(250),))))


TREES = {"transformer": transformer(), "tied": transformer(tied=True), "flat": flat(),
         "experts": transformer(layers=3, experts=5), "checkpointed": transformer(checkpointed=True)}
CONFIGS = [
    {"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 0,
     "stage3_param_persistence_threshold": 0},
    {"stage3_prefetch_bucket_size": 50, "stage3_max_live_parameters": 400, "stage3_max_reuse_distance": 400,
     "stage3_param_persistence_threshold": 10},
    {"stage3_prefetch_bucket_size": 100, "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 0,
     "stage3_param_persistence_threshold": 0},
    {"stage3_prefetch_bucket_size": 30, "stage3_max_live_parameters": 300, "stage3_max_reuse_distance": 10**9,
     "stage3_param_persistence_threshold": 5},
]


def settings(config):
    return Settings(prefetch_bucket=config["stage3_prefetch_bucket_size"],
                    max_live=config["stage3_max_live_parameters"], max_reuse=config["stage3_max_reuse_distance"],
                    persistence_threshold=config["stage3_param_persistence_threshold"])


def as_json(m: Module) -> dict:
    return {"params": [list(p) for p in m.params], "children": [as_json(c) for c in m.children],
            "checkpointed": m.checkpointed}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from tests.subprocess_probe import run_json_probe
    cases = [{"tree": as_json(tree), "config": c} for tree in TREES.values() for c in CONFIGS]
    path = tmp_path_factory.mktemp("zero3") / "cases.json"
    path.write_text(json.dumps(cases))
    return iter(run_json_probe("tests/deepspeed_zero3_probe.py", extra_args=[str(path)])["cases"])


@pytest.mark.parametrize("tree_name", list(TREES))
def test_port_replays_the_coordinator(real, tree_name):
    tree = TREES[tree_name]
    for config in CONFIGS:
        steps = next(real)["steps"]
        calls = [tuple(e[:3]) for e in steps[1]]
        assert calls == hook_events(tree), (tree_name, config)
        measured = [e[3] for step in steps[1:] for e in step if e[0] == "fetch"]
        assert replay(tree, settings(config), steps=2) == measured, (tree_name, config)


def test_hook_order_by_hand():
    # root(emb, layer(a, b)): the backward mirrors the forward; the root and the embedding see no input gradient,
    # so their post-backward hooks never run and release_backward_leftovers releases them
    tree = Module((), (Module(((1, 10),)), Module((), (Module(((2, 5),)), Module(((3, 5),))))))
    assert hook_events(tree) == [
        ("fetch", 0, True), ("fetch", 1, True), ("release", 1, True), ("fetch", 2, True), ("fetch", 3, True),
        ("release", 3, True), ("fetch", 4, True), ("release", 4, True), ("release", 2, True), ("release", 0, True),
        ("fetch", 0, False), ("fetch", 2, False), ("fetch", 4, False), ("release", 4, False), ("fetch", 3, False),
        ("release", 3, False), ("release", 2, False), ("fetch", 1, False), ("leftovers", -1, False)]


def test_without_prefetch_or_reuse_one_module_at_a_time():
    # no prefetch and no reuse distance: each module's parameters are released after it, so the most held is the
    # largest module (the embedding, 250), by hand
    s = Settings(prefetch_bucket=0, max_reuse=0, persistence_threshold=0)
    assert gathered_elements(flat(), s) == 250


def test_reuse_distance_keeps_the_turn_gathered():
    # flat(): 250 | 8 x (100 + 4) | 250. With a reuse distance of 10**9 every parameter used again in the step
    # stays gathered from its forward to its backward: the whole model, 250 + 8 x 104 + 250 = 1332, at the output
    # layer's backward fetch (no prefetch)
    s = Settings(prefetch_bucket=0, max_reuse=10**9, persistence_threshold=0)
    assert gathered_elements(flat(), s) == 1332
    # a distance under the output layer's two uses (250 + 250) keeps nothing but the output layer between them
    s = Settings(prefetch_bucket=0, max_reuse=400, persistence_threshold=0)
    assert gathered_elements(flat(), s) == 250


@pytest.mark.parametrize("name", ["llama3-8b", "gpt3-175b", "bloom-176b", "mixtral-8x7b", "qwen3-30b-a3b",
                                  "gpt-oss-20b", "tiny-gpt"])
@pytest.mark.parametrize("tp", [1, 4])
def test_the_module_tree_holds_the_gpus_parameters(name, tp):
    """Megatron-DeepSpeed's module tree plan3d replays (planner/frameworks/deepspeed.py zero3_tree) holds the GPU's
    parameters as planner.memory counts them on one stage (each tied weight once), within 0.1 % (norms of Q/K and
    rounding of TP splits)."""
    from planner.frameworks.deepspeed import zero3_shape, zero3_tree
    from planner.memory import stage_params_per_rank
    from planner.presets import load_model
    from planner.specs import Plan

    model = load_model(name)
    held = {pid: n for m in flatten(zero3_tree(zero3_shape(model, tp))) for pid, n in m.params}
    want = stage_params_per_rank(model, Plan(tp=tp, pp=1, dp=1, micro_batch_size=1), 0, model.num_layers)
    assert sum(held.values()) == pytest.approx(want, rel=1e-3)
