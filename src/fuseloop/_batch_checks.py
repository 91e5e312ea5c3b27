"""Checks of one batch's form: Python lists where arrays belong, x and y of different
sizes, dtypes no device holds, and the signatures batches are compared by (used by
`_checks.Checker`; the labels' values are `_label_rule`'s)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from ._graph_batch import (
    check_rows_of_a_mixed_x,
    graph_hint,
    graph_like,
    indexes_its_rows,
    rows_unknown,
)
from ._prng_keys import is_typed_keys
from ._python_lists import (
    check_python_lists,
    is_number_list,
    number_lists,
    refuse_per_example_lists,
    refuse_python_list,
)
from ._unsliceable import masked_fix, typed_keys_fix

__all__ = [
    "check_pair_sizes",
    "check_python_lists",
    "is_number_list",
    "number_lists",
    "refuse_per_example_lists",
    "refuse_python_list",
    "held_by_no_device",
    "no_device_dtype",
    "refuse_no_device_dtype",
    "numbers_fix",
    "leaf_signature",
    "require_pair",
    "shape_and_dtype",
]


def _leading_sizes(tree: Any) -> list[int]:
    return [int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(tree) if np.ndim(leaf) >= 1]


class MixedRows(NamedTuple):
    """The first batch's verdict on unlabelled data (y without rows) whose x's leaves hold
    different numbers of rows (`rows`, in leaf order): batches of those rows weigh alike
    whichever leaf holds the examples."""

    rows: tuple[int, ...]


def check_pair_sizes(
    batch: Any, where: str, named_loss: bool = False, graph: bool | MixedRows | None = None
) -> bool | MixedRows:
    """x and y of one batch hold the same number of examples, and at least one; under a
    `named_loss` (one per example), y has an example axis (a loss of the user's own may
    ignore y, as an autoencoder's dummy scalar). Whether it is a graph batch, whose x's
    leaves hold different numbers of rows (`graph`: the run's first batch's verdict; None:
    this is the first), or a `MixedRows`. A later batch reaches here only where its
    signature differs from the first's."""
    x_sizes, y_sizes = _leading_sizes(batch[0]), _leading_sizes(batch[1])
    if 0 in x_sizes[:1] + y_sizes[:1]:
        raise ValueError(
            f"data: {where} holds no examples (x and y have 0 rows on axis 0). A step on an "
            f"empty batch would still move the optimizer, and its mean loss is NaN. Leave "
            f"empty batches out of the data (a loop slicing one batch past the end, such as "
            f"range(0, n + batch_size, batch_size), makes one)"
        )
    y_leaves = jax.tree.leaves(batch[1])
    if named_loss and x_sizes and y_leaves and not y_sizes:
        raise ValueError(
            f"data: {where}: y has no example axis (shape {np.shape(y_leaves[0])}), while x "
            f"has {x_sizes[0]} along axis 0: does the source yield single examples (as a "
            f"torch Dataset's items are) rather than batches? A batch stacks its examples "
            f"on axis 0 of every leaf: pass fl.data.arrays(x, y, batch_size=32), or yield "
            f"(x[i:i + b], y[i:i + b])"
        )
    if not y_sizes:  # x's rows are the examples: no leaf says which, where they differ
        mixed = len(set(x_sizes)) > 1
        if graph is None:
            return MixedRows(tuple(x_sizes)) if mixed else False
        first = graph.rows if isinstance(graph, MixedRows) else None
        changed = mixed if first is None else first != tuple(x_sizes)
        if changed and (first is None or len(first) == len(x_sizes)):  # else: the structure's
            raise ValueError(rows_unknown(batch[0], where))
        return graph
    if not x_sizes:
        return False
    first_batch = graph is None
    if graph is None:
        graph = len(set(x_sizes)) > 1 and graph_like(batch, where, y_sizes[0])
        # Nodes and edges padded to one budget, per-graph targets: y's rows tell the examples.
        graph = graph or (y_sizes[0] != x_sizes[0] and indexes_its_rows(batch[0], y_sizes[0]))
    if graph:  # a graph's nodes and edges: y's rows are the examples
        check_rows_of_a_mixed_x(batch, where, y_sizes)
        return True
    bad = [size for size in y_sizes if size != x_sizes[0]]
    if bad:
        raise ValueError(
            f"data: {where}: x holds {x_sizes[0]} examples but {_odd_target(batch[1], bad[0])}; "
            f"x and y of a batch must have the same size along axis 0 (one target per example)"
            + _closure_hint(y_sizes, x_sizes[0])
            + graph_hint(batch[0], first_batch)
        )
    return False


def _odd_target(y: Any, size: int) -> str:
    """`y holds 7`, naming the leaf of a structured y (`y['class_weights'] (shape (7,))`)."""
    leaves = jax.tree_util.tree_flatten_with_path(y)[0]
    if len(leaves) < 2:
        return f"y holds {size}"
    path, leaf = next((p, v) for p, v in leaves if np.ndim(v) >= 1 and np.shape(v)[0] == size)
    return f"y{jax.tree_util.keystr(path)} (shape {np.shape(leaf)}) holds {size}"


def _closure_hint(y_sizes: list[int], examples: int) -> str:
    """Where other targets do have one row per example, the odd one is likely a value shared
    by the whole batch (class weights, a vocabulary table): the loss's closure takes it."""
    if examples not in y_sizes:
        return ""
    return (
        ". A value shared by every example (class weights, a lookup table) belongs in the "
        "loss function, not in y: functools.partial(my_loss, class_weights=w)"
    )


def held_by_no_device(dtype: Any) -> bool:
    """Whether no device holds arrays of `dtype`: strings, bytes, Python objects (a mixed
    pandas frame's `.values`), structured records; not the ml_dtypes floats (kind "V").

    Example:
        >>> held_by_no_device(np.dtype(object)), held_by_no_device(np.dtype(jax.numpy.bfloat16))
        (True, False)
    """
    dtype = np.dtype(dtype)
    return dtype.kind in "OSUV" and not jax.numpy.issubdtype(dtype, jax.numpy.number)


def numbers_fix(name: str, leaf: Any, cast: str = "float32", mapping: str = "") -> str:
    """How to make `name` (`leaf`, of a dtype no device holds) numbers: a cast to `cast`
    where its values are numbers already (Python numbers in an object array, numbers
    written as text), else a mapping (`mapping`; by default class indices for a y, an
    encoding for an x). An abstract leaf, whose values are unknown, gets both.

    Example:
        >>> print(numbers_fix("y", np.array([0, 1], dtype=object)))
        its values are numbers held as Python objects (...): cast them, e.g. y.astype(np.float32)
        >>> print(numbers_fix("y", np.array(["cat", "dog"])))
        map them to numbers first, e.g. for labels, classes, y = np.unique(y, return_inverse=True)
    """
    cast_it = f"{name}.astype(np.{cast})"
    if not mapping and name.startswith("y"):
        mapping = (
            f"map them to numbers first, e.g. for labels, classes, {name} = "
            f"np.unique({name}, return_inverse=True)"
        )
    elif not mapping:  # inputs: categories, words
        mapping = "map them to numbers first, e.g. each category to an integer or a one-hot row"
    if not isinstance(leaf, (np.ndarray, np.generic)):
        return f"cast it where its values are numbers ({cast_it}), else {mapping}"
    if leaf.dtype.names:  # a structured (record) array: its fields are the arrays
        fields = ", ".join(f"{name}[{field!r}]" for field in leaf.dtype.names[:3])
        return f"its rows are records: pass their fields as arrays of their own ({fields})"
    first = leaf.flat[0] if leaf.dtype.kind == "O" and leaf.size else None
    if isinstance(first, (np.ndarray, list, tuple)):  # a pandas Series of rows
        return (
            f"its values are arrays held as Python objects, one per row: stack them, "
            f"e.g. np.stack({name}).astype(np.{cast})"
        )
    try:  # an error path: reading the values once costs nothing that matters
        leaf.astype(np.float64)
    except (TypeError, ValueError):
        return mapping
    held = (
        "held as Python objects (as a mixed pandas frame's .values holds them)"
        if leaf.dtype.kind == "O"
        else "written as text"
    )
    return f"its values are numbers {held}: cast them, e.g. {cast_it}"


def no_device_dtype(tree: Any, name: str, reader: str = "") -> str | None:
    """What is wrong with the first leaf of `tree` (`name`: x or y) whose dtype no device
    holds (strings, objects), and the fix; None where a device holds every leaf. JAX's own
    error names only the dtype, and shape advice that followed it misled. `reader`: what
    would read the leaf, for the message.

    Example:
        >>> print(no_device_dtype({"a": np.array(["1.5"])}, "x"))
        x['a'] has dtype <U3, which no device holds; its values are numbers written as text: ...
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        masked = masked_fix(name + jax.tree_util.keystr(path), leaf)
        if masked is not None:
            return masked
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:  # a Python list or number
            try:
                dtype = np.asarray(leaf).dtype
            except (TypeError, ValueError):  # ragged: the checks of its shape name it
                continue
        if is_typed_keys(dtype):
            return typed_keys_fix(name + jax.tree_util.keystr(path), dtype)
        if held_by_no_device(dtype):
            named = name + jax.tree_util.keystr(path)
            read = f", so {reader} cannot read it" if reader else ""
            return f"{named} has dtype {dtype}, which no device holds{read}; " + numbers_fix(
                named, leaf
            )
    return None


def refuse_no_device_dtype(batch: Any) -> None:
    """Raises `no_device_dtype`'s ValueError for a custom loop's batch (`batch[...]`),
    before JAX fails to read the leaf as an array.

    Example:
        >>> refuse_no_device_dtype((np.zeros(2), np.array(["a", "b"])))
        Traceback (most recent call last):
        ValueError: data: batch[1] has dtype <U1, which no device holds; ...
    """
    wrong = no_device_dtype(batch, "batch")
    if wrong is not None:
        raise ValueError(f"data: {wrong}")


def leaf_signature(leaf: Any) -> tuple[Any, Any]:
    """`(shape, dtype)` of an array leaf; Python scalars are weakly typed, so their type."""
    shape = getattr(leaf, "shape", None)
    if shape is not None and hasattr(leaf, "dtype"):
        return tuple(shape), leaf.dtype
    return (), type(leaf).__name__


def shape_and_dtype(leaf: Any) -> tuple[Any, Any]:
    """A leaf's shape and dtype for a cache key: read directly from arrays (`np.shape` and
    jax's `result_type` cost the host ~0.5 and ~15 us a leaf, paid on every run); Python
    scalars go through jax's rules."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return np.shape(leaf), jax.numpy.result_type(leaf)
    return tuple(leaf.shape), dtype


def require_pair(batch: Any, where: str = "a batch", data: Any = None) -> None:
    """Raises a ValueError saying what `where` is, unless `batch` is a pair `(x, y)`.

    `data`, the run's data where the caller has it: a list or tuple whose second item is
    an array is whole arrays given as a pair (x, y), x perhaps a model's several inputs
    (a pair of them reads as a first batch (x, y), so it is refused here too).
    """
    second = data[1] if isinstance(data, (tuple, list)) and len(data) == 2 else None
    whole_shape = tuple(getattr(second, "shape", ()))  # numpy, jax or torch: y of the set
    whole = len(whole_shape) >= 1
    pair = isinstance(batch, (tuple, list)) and len(batch) == 2
    if pair and not whole:
        return
    kind = type(batch).__name__
    size = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    shape = getattr(batch, "shape", None)
    hint = ""
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        hint = (
            " For Keras's (x, y, sample_weight), yield (x, {'y': y, 'weight': w}) and train "
            "with a loss callable(y_true, y_pred) returning (y_true['weight'] * "
            "per_example_loss).mean(), Keras's default weighting."
        )
    if shape is not None and len(shape) >= 1:
        size = f" of shape {tuple(shape)}"
    if whole or (shape is not None and len(shape) >= 1):
        hint = (
            " If you passed whole arrays as a pair (x, y), iterating over it yields x "
            "and then y: batch them with fl.data.arrays(x, y, batch_size=...) instead"
            + (" (x may be a tuple or dict of a model's several inputs)." if whole else ".")
        )
    if isinstance(data, Mapping):
        keys = ", ".join(map(repr, list(data)[:4]))
        hint = (
            f" A dict given as the data is iterated over its keys ({keys}): for whole "
            f"arrays, batch them with fl.data.arrays(x, y, batch_size=...) "
            f"(x may be a dict of a model's several inputs)."
        )
    if pair:  # x the pair of a model's two inputs, y the second "batch"
        raise ValueError(
            f"data: {where} reads as a pair (x, y), but the item after it is an array of "
            f"shape {whole_shape}, not a batch (y for the whole set?).{hint}"
        )
    raise ValueError(
        f"data: {where} is a {kind}{size}, but a trainer or evaluator batch must be a "
        f"pair (x, y).{hint} Yield (inputs, targets) tuples (unlabelled data, for an "
        f"autoencoder or a contrastive loss: (x, None), or fl.data.arrays(x, None, "
        f"batch_size=...)), or use fl.loop(step_fn) for other batch structures"
    )
