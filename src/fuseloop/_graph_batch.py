"""Padded graph batches (nodes, edges, a graph index per node: x's leaves hold different
numbers of rows), told apart from x and y that do not belong together; y's rows are such a
batch's examples (`_batch_checks.check_pair_sizes` asks, docs/data.md). Without y's rows
(unlabelled data), such an x is refused where a batch is shaped otherwise (`rows_unknown`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = [
    "ONE_BUDGET",
    "graph_hint",
    "check_rows_of_a_mixed_x",
    "graph_like",
    "holds_an_index",
    "indexes_its_rows",
    "rows_of",
    "rows_unknown",
]


# Why a later graph batch of other rows is refused where the run's first read as plain data.
ONE_BUDGET = (
    " (graph batches whose first held as many node rows as edge rows, with a target per "
    "node, read as plain data: pad every batch to that one budget)"
)
# What makes a first batch of one budget with fewer targets than rows a graph batch.
GRAPH_IDS = (
    " (a graph batch padded to one budget for nodes and edges, with a target per graph, "
    "gives x each node's graph index in order and below y's rows, its padding nodes in the "
    "padding graph, the last, as jraph.pad_with_graphs makes it, y holding a row for it)"
)


def graph_hint(x: Any, first: bool) -> str:
    """ONE_BUDGET for a later batch, GRAPH_IDS for a first, where `x` may be a graph batch
    (`holds_an_index` of its leaves with rows); else nothing."""
    leaves = [leaf for leaf in jax.tree.leaves(x) if np.ndim(leaf) >= 1]
    if not holds_an_index([(np.shape(leaf), getattr(leaf, "dtype", "")) for leaf in leaves]):
        return ""
    return GRAPH_IDS if first else ONE_BUDGET


def holds_an_index(leaves: list[tuple[tuple[int, ...], Any]]) -> bool:
    """Whether, among x's leaves as `(shape, dtype)`, a vector of integers (an index: a
    graph's senders, receivers or graph ids) stands beside leaves of other kinds."""
    vectors = [1 for shape, dtype in leaves if len(shape) == 1 and _integer(dtype)]
    return bool(vectors) and len(vectors) < len(leaves)


def _integer(dtype: Any) -> bool:
    return "int" in str(dtype)  # a torch tensor's dtype too


def _integers(leaf: Any) -> bool:
    return _integer(getattr(leaf, "dtype", ""))


def graph_like(batch: Any, where: str, examples: int) -> bool:
    """Whether an x whose leaves hold different numbers of rows is a graph batch: one
    with an index array (a graph's senders, receivers or graph ids: integers), or one of
    whose leaves holds y's rows. Any other is refused as x and y that do not belong
    together (a leaf sliced to other rows by mistake)."""
    paths = jax.tree_util.tree_flatten_with_path(batch[0])[0]
    with_rows = [(path, leaf) for path, leaf in paths if np.ndim(leaf) >= 1]
    indexed = any(_integers(leaf) for _, leaf in with_rows)
    if indexed or any(np.shape(leaf)[0] == examples for _, leaf in with_rows):
        return True
    raise ValueError(
        f"data: {where}: x's leaves hold different numbers of rows ({rows_of(batch[0])}) and "
        f"y holds {examples}, which none of them holds; x and y of a batch hold one row per "
        f"example (a padded graph batch, whose x holds nodes and edges, has integer index "
        f"arrays beside them). Check that x and y belong together"
    )


def indexes_its_rows(x: Any, examples: int) -> bool:
    """Whether a first batch's `x` whose leaves all hold one number of rows (nodes and
    edges padded to one budget) is a padded graph batch of `examples` graphs, y's rows:
    beside leaves of other kinds, it holds each node's graph index, a vector of integers
    in [0, examples), in order (padding nodes in the last graph, as jraph.pad_with_graphs
    puts them). A categorical column's codes beside a y of other rows (a slicing mistake)
    would have to be sorted and below y's rows too. Asked only of a batch refused otherwise."""
    leaves = [leaf for leaf in jax.tree.leaves(x) if np.ndim(leaf) >= 1]

    def graph_ids(leaf: Any) -> bool:
        if np.ndim(leaf) != 1 or not _integers(leaf):
            return False
        values = np.asarray(leaf)
        ordered = bool(np.all(values[1:] >= values[:-1]))
        return bool(values.size) and ordered and values[0] >= 0 and values[-1] < examples

    index_leaves = [leaf for leaf in leaves if graph_ids(leaf)]
    return bool(index_leaves) and len(index_leaves) < len(leaves)


def check_rows_of_a_mixed_x(batch: Any, where: str, y_sizes: list[int]) -> None:
    """An x whose leaves hold different numbers of rows (a padded graph batch: nodes,
    edges, a graph index per node) has no one example count of its own: y's rows are the
    examples (nodes, edges or graphs), so y's leaves agree on them."""
    examples = y_sizes[0]
    odd = [size for size in y_sizes if size != examples]
    if not odd:
        return
    rows = rows_of(batch[1], "y")
    raise ValueError(
        f"data: {where}: x's leaves hold different numbers of rows (as a graph's nodes and "
        f"edges do), so y's rows are the batch's examples, but y's leaves disagree on them "
        f"({rows}). Give y one row per example in every leaf (a per-node mask belongs in "
        f"x when the targets are per graph)"
    )


def rows_of(tree: Any, name: str = "x") -> str:
    """Each leaf's rows along axis 0, by name: "x['nodes']: 16, x['edges']: 32"."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ", ".join(
        f"{name}{jax.tree_util.keystr(path)}: {np.shape(leaf)[0]}"
        for path, leaf in paths
        if np.ndim(leaf) >= 1
    )


def rows_unknown(x: Any, where: str) -> str:
    """The refusal of a batch of unlabelled data (y without rows) shaped unlike the run's
    first, where x's leaves hold different numbers of rows in either: the loss and metrics
    weigh a batch by its examples, and no leaf says which rows they are (the first in key
    order would be taken, by chance). Batches that all share the first's shapes weigh alike
    whichever it is, so they run."""
    return (
        f"data: {where}: y holds no examples, so they are counted on x, but x's leaves hold "
        f"different numbers of rows ({rows_of(x)}) in this batch or the run's first, and "
        f"fuseloop cannot tell which are the examples it weighs this batch's loss and "
        f"metrics by. Keep what is not one row per example (weights, a lookup table) out "
        f"of x: close over it in the model or the loss; or give y a leaf with one row per "
        f"example (e.g. (x, np.zeros(n)) for n examples); or make every batch the same "
        f"shape (drop_remainder=True, or pad the last one)"
    )
