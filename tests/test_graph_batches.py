"""Padded graph batches: x's leaves hold different numbers of rows (nodes, edges, a graph
index per node), y holds one target per node or per graph, and y's rows are the examples."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, host

F = 3


def graph_batch(rng: np.random.Generator, graphs: int, nodes_per_graph: int = 4) -> dict:
    """A padded batch of `graphs` graphs: 2 edges per node, keys in jraph's spirit."""
    nodes, edges = graphs * nodes_per_graph, 2 * graphs * nodes_per_graph
    return {
        "edges": rng.random((edges, 1)).astype(np.float32),  # sorts first: not the examples
        "graph_of_node": np.repeat(np.arange(graphs, dtype=np.int32), nodes_per_graph),
        "nodes": rng.normal(size=(nodes, F)).astype(np.float32),
        "receivers": rng.integers(0, nodes, edges).astype(np.int32),
        "senders": rng.integers(0, nodes, edges).astype(np.int32),
    }


def init(key, x):
    return {"w": jax.random.normal(key, (F, 3)) * 0.3}


def node_logits(params, x):
    h = x["nodes"] @ params["w"]
    messages = h[x["senders"]] * x["edges"]
    return h + jax.ops.segment_sum(messages, x["receivers"], x["nodes"].shape[0])


def graph_logits(params, x):
    graphs = x["graph_of_node"].shape[0] // 4
    return jax.ops.segment_sum(node_logits(params, x), x["graph_of_node"], graphs)


def loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def hand_loop(apply, data, params):
    """Plain SGD over `data`, one jitted step per batch; the mean loss weighed by y's rows."""

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(lambda p: loss(y, apply(p, x)))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    total = rows = 0.0
    for x, y in data:
        params, value = step(params, x, y)
        total, rows = total + float(value) * len(y), rows + len(y)
    return params, total / rows


def assert_as_the_hand_loop(state, apply, data, start):
    params, mean_loss = hand_loop(apply, data, start)
    np.testing.assert_allclose(host(state.params["w"]), host(params["w"]), rtol=1e-5)
    assert state.metrics["loss"] == pytest.approx(mean_loss, rel=1e-5)


@pytest.mark.parametrize("level", ["node", "graph"])
def test_graph_batches_train_as_a_hand_written_loop_fused_and_unfused(level):
    rng = np.random.default_rng(0)
    graphs = [graph_batch(rng, 2) for _ in range(4)]
    rows = [len(x["nodes"]) if level == "node" else 2 for x in graphs]
    data = [(x, rng.integers(0, 3, n).astype(np.int32)) for x, n in zip(graphs, rows, strict=True)]
    apply = node_logits if level == "node" else graph_logits
    model = fl.models.from_functions(init, apply)
    start = init(jax.random.key(0), None)
    unfused = fl.trainer(model, loss, optax.sgd(0.1)).run(data, start, fuse=False)
    fused = fl.trainer(model, loss, optax.sgd(0.1)).run(data, start, fuse=2)
    assert_tree_equal(fused.params, unfused.params, "fused against unfused params")
    assert fused.metrics == unfused.metrics
    assert_as_the_hand_loop(unfused, apply, data, start)


def test_a_last_batch_of_fewer_graphs_is_weighed_by_its_graphs():
    rng = np.random.default_rng(1)
    data = [(graph_batch(rng, n), rng.integers(0, 3, n).astype(np.int32)) for n in (3, 3, 1)]
    model = fl.models.from_functions(init, graph_logits)
    start = init(jax.random.key(1), None)
    with pytest.warns(UserWarning, match="has batch size 1 instead of 3"):
        state = fl.trainer(model, loss, optax.sgd(0.1)).run(data, start)
    assert_as_the_hand_loop(state, graph_logits, data, start)


def test_a_second_padding_of_other_rows_is_refused_with_a_fixed_budget_as_the_fix():
    rng = np.random.default_rng(2)
    data = [(graph_batch(rng, n), rng.integers(0, 3, n).astype(np.int32)) for n in (3, 2, 1)]
    loop = fl.trainer(fl.models.from_functions(init, graph_logits), loss, optax.sgd(0.1))
    with (
        pytest.warns(UserWarning, match="batch size 2 instead of 3"),
        pytest.raises(ValueError, match=r"is padded to other rows.*y: 1\).*padding budget"),
    ):
        loop.run(data, epochs=1, fuse=False)


def test_ys_leaves_of_other_rows_beside_a_graph_batch_are_refused_by_name():
    rng = np.random.default_rng(3)
    x = graph_batch(rng, 2)
    y = {"label": np.zeros(2, np.int32), "node_mask": np.ones(8, np.float32)}
    loop = fl.trainer(
        fl.models.from_functions(init, graph_logits), lambda y, p: loss(y["label"], p), "sgd"
    )
    with pytest.raises(ValueError, match=r"y's leaves disagree.*y\['label'\]: 2.*node_mask'\]: 8"):
        loop.run([(x, y)], epochs=1)


def test_batches_whose_rows_do_not_belong_together_are_still_refused():
    loop = fl.trainer(fl.models.from_functions(init, lambda p, x: x["a"] @ p["w"]), loss, "sgd")
    full = (
        {"a": np.zeros((4, F), np.float32), "b": np.zeros((4, 1), np.float32)},
        np.zeros(4, np.int32),
    )
    with pytest.raises(ValueError, match="x holds 4 examples but y holds 3"):
        loop.run([(full[0]["a"], np.zeros(3, np.int32))], epochs=1)
    # x's leaves of other rows, no index array, y's rows in none of them: not a graph
    sliced = (
        {"a": np.zeros((4, F), np.float32), "b": np.zeros((2, 1), np.float32)},
        np.zeros(3, np.int32),
    )
    with pytest.raises(ValueError, match=r"x\['b'\]: 2\) and y holds 3, which none of them"):
        loop.run([sliced], epochs=1)
    # a run of uniform batches: a later batch with one leaf left long is not a graph batch
    stale = (
        {"a": np.zeros((4, F), np.float32), "b": np.zeros((3, 1), np.float32)},
        np.zeros(3, np.int32),
    )
    with pytest.raises(ValueError, match="iteration 1: x holds 4 examples but y holds 3"):
        loop.run([full, stale], epochs=1, fuse=False)


def test_predict_on_graph_batches_says_to_call_the_model_per_batch():
    rng = np.random.default_rng(4)
    batches = [graph_batch(rng, 2) for _ in range(2)]
    params = {"w": jnp.ones((F, 3))}
    model = fl.models.from_functions(init, node_logits)
    with pytest.raises(ValueError, match=r"over all the batches given.*call the model on each"):
        fl.predict(model, params, batches)


def test_unlabelled_batches_of_mixed_rows_run_until_a_batch_of_other_shapes():
    """Without y's rows, no leaf of x says which rows are the examples. Batches of the first
    one's shapes weigh alike whichever it is, so they run; a batch shaped otherwise (a short
    last one beside a teacher's table) would be weighed by whichever leaf sorts first, so it
    is refused, naming the leaves, rather than guessed."""
    model = fl.models.from_functions(init, lambda p, x: x["x"] @ x["table"] @ p["w"])
    own = lambda y, out: jnp.mean(out**2)  # noqa: E731 - an unsupervised loss of its own
    rng = np.random.default_rng(0)

    def batch(n):
        x = rng.normal(size=(n, F)).astype(np.float32)
        return {"table": np.eye(F, dtype=np.float32), "x": x}, None

    params = {"w": np.ones((F, 3), np.float32)}
    uniform = [batch(8), batch(8)]
    for loop in (fl.trainer(model, own, "sgd"), fl.evaluator(model, own)):
        start = None if loop.program.kind == "trainer" else params
        assert loop.run(uniform, start).status == "completed"
        for last in (2, F):  # the table's rows (3, 3) then, though the first batch's differ
            with pytest.raises(ValueError, match="iteration 2: y holds no examples") as got:
                loop.run([*uniform, batch(last)], start)
            assert f"x['table']: 3, x['x']: {last}" in str(got.value)
    # Of the first batch's rows, a later batch runs: float64 (cast, with its warning), and a
    # per-example metric of the output's rows is not said to be per class.
    wide = [uniform[0], ({**uniform[1][0], "x": uniform[1][0]["x"].astype(np.float64)}, None)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "data: .* float64")
        warnings.filterwarnings("error", "metric .* not values per example")
        each = fl.trainer(model, own, "sgd").metric(lambda y, out: jnp.mean(out**2, -1), "each")
        assert each.run(wide, fuse=False).status == "completed"
    # A later batch without the table is told its structure, not its rows.
    with pytest.raises(ValueError, match="iteration 1 has structure"):
        fl.trainer(model, own, "sgd").run([uniform[0], ({"x": uniform[1][0]["x"]}, None)])
    # Uniform leaves at first, mixed later: the later batch is refused too.
    with pytest.raises(ValueError, match=r"iteration 1: y holds .* x\['x'\]: 2\)"):
        fl.trainer(model, own, "sgd").run([batch(F), batch(2)])
    # y with one row per example says which: the loss is weighed by its rows
    labelled = [(x, np.zeros(len(x["x"]), np.int32)) for x, _ in (*uniform, batch(2))]
    with pytest.warns(UserWarning, match="ragged last batch"):
        assert fl.trainer(model, own, "sgd").run(labelled).status == "completed"


def padded(rng: np.random.Generator, graphs: int, nodes: int, edges: int) -> dict:
    """`graph_batch`'s keys for `graphs` graphs of 4 nodes, padded to `nodes` and `edges`
    rows: padding nodes in the last graph, as jraph.pad_with_graphs puts them, padding
    edges joining node 0 to itself with weight 0."""
    real = graph_batch(rng, graphs)
    n, e = len(real["nodes"]), len(real["edges"])
    out = {
        "nodes": np.concatenate([real["nodes"], np.zeros((nodes - n, F), np.float32)]),
        "graph_of_node": np.concatenate(
            [real["graph_of_node"], np.full(nodes - n, graphs - 1, np.int32)]
        ),
    }
    for key in ("edges", "receivers", "senders"):
        out[key] = np.concatenate(
            [real[key], np.zeros((edges - e, *real[key].shape[1:]), real[key].dtype)]
        )
    return out


def test_graph_batches_padded_to_one_budget_for_nodes_and_edges_are_graph_batches():
    # With as many edge rows as node rows, every leaf of x held one number of rows, and
    # the batch was taken for plain data: per-graph labels were refused.
    rng = np.random.default_rng(5)

    def graph_logits(params, x):  # two graphs a batch, their padding nodes in the last
        return jax.ops.segment_sum(node_logits(params, x), x["graph_of_node"], 2)

    per_graph = [(padded(rng, 2, 16, 16), rng.integers(0, 3, 2).astype(np.int32)) for _ in range(3)]
    model = fl.models.from_functions(init, graph_logits)
    start = init(jax.random.key(2), None)
    for fuse in (False, 3):
        state = fl.trainer(model, loss, optax.sgd(0.1)).run(per_graph, start, fuse=fuse)
        assert_as_the_hand_loop(state, graph_logits, per_graph, start)
    per_node = [(padded(rng, 4, 32, 32), rng.integers(0, 3, 32).astype(np.int32)) for _ in range(2)]
    per_node.append((padded(rng, 1, 4, 12), rng.integers(0, 3, 4).astype(np.int32)))
    node_model = fl.models.from_functions(init, node_logits)
    # A target per node: the first batch reads as plain data, so its last batch must keep
    # the one budget (a tabular batch with small integer codes could not be told apart).
    with pytest.raises(ValueError, match=r"x holds 12 examples but y holds 4.*one budget"):
        fl.trainer(node_model, loss, optax.sgd(0.1)).run(per_node, start, fuse=False)
    smaller = per_graph[:2] + [(padded(rng, 2, 8, 16), per_graph[2][1])]
    with pytest.raises(fl.FusionError, match="pad every graph batch to the run's budget"):
        fl.trainer(model, loss, optax.sgd(0.1)).run(smaller, start, fuse=3)
    # As many graphs padded to another edge budget: no "batch size 2 instead of 2".
    wider = per_graph[:2] + [(padded(rng, 2, 16, 24), per_graph[2][1])]
    with pytest.warns(UserWarning, match=r"padded to other rows .*with as many examples"):
        fl.trainer(model, loss, optax.sgd(0.1)).run(wider, start, fuse=False)
