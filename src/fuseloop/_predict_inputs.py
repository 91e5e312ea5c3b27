"""`fl.predict`'s inputs read from a batch source: every batch's x, copied as pulled,
joined in order into one array per leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._data import as_host_array, as_source, own_copy
from ._unsliceable import refuse_unsliceable
from .models import without_params

__all__ = ["host", "inputs_of_source", "no_variables"]


def host(leaf: Any) -> np.ndarray:
    """`leaf` as a numpy array."""
    return np.asarray(as_host_array(leaf))  # a torch tensor through Tensor.numpy()


def inputs_of_source(source: Any) -> tuple[Any, int | list[int], bool]:
    """All inputs of a batch source (batches `x` or `(x, y)`), concatenated in order, the
    size of each batch, and whether some were pairs with a y (read as `(x, y)`). An
    `fl.data.arrays` source's epochs may be shuffled and drop a short last batch, so its
    arrays are taken as they are, cut by its batch size (returned alone): one output per row
    of them.
    """
    from .data import ArraySource  # the public module, imported when predict is called

    if isinstance(source, ArraySource):
        return source.x, source.batch_size, False

    wrapped = as_source(source, reader="predict")
    iterator = wrapped.epoch_iterator(0)
    inputs: list[Any] = []
    pairs = False
    # An iterator or a callable's may refill one array for every batch: each is copied as
    # pulled. A list's batches are its own arrays, joined below without a copy first.
    keep = (lambda x: x) if isinstance(source, (list, tuple)) else own_copy
    try:
        for batch in iterator:
            pair = isinstance(batch, (tuple, list)) and len(batch) == 2
            pairs = pairs or (pair and batch[1] is not None)  # (x, None) is x alone
            x = batch[0] if pair else batch
            refuse_unsliceable(x, f"x (batch {len(inputs)} of the source)")
            inputs.append(jax.tree.map(keep, x))
    finally:
        wrapped.close()
    if not inputs:
        raise ValueError("x: the batch source yielded no batch; there is nothing to predict")
    for x in inputs:  # a per-batch value (a temperature): no examples to join
        leaves = jax.tree_util.tree_flatten_with_path(x)[0]
        scalar = next((path for path, leaf in leaves if np.ndim(leaf) == 0), None)
        if scalar is not None and any(np.ndim(leaf) >= 1 for _, leaf in leaves):
            raise ValueError(
                f"x{jax.tree_util.keystr(scalar)} is a scalar (shape ()) in the source's "
                f"batches, while predict joins every input's examples along axis 0: give it "
                f"one value per example (np.full(n, value)), or let the model hold a value "
                f"shared by all of them"
            )
    first = jax.tree.leaves(inputs[0])
    size = int(np.shape(first[0])[0]) if first and np.ndim(first[0]) >= 1 else 0
    if size == 0:
        listed = ""
        if isinstance(source, (list, tuple)):  # of numbers, or of rows of them
            listed = (
                f"; a {type(source).__name__} is read as a list of batches, and its items "
                f"are {type(source[0]).__name__}s: for a {type(source).__name__} of rows or "
                f"numbers, pass np.asarray(x, np.float32) (np.asarray(x, np.int32) for ids)"
            )
        raise ValueError(
            f"x: the batch source's batches have no batch axis; yield arrays (or (x, y) "
            f"pairs) with the examples on axis 0{listed}"
        )
    _require_alike(inputs)
    joined = jax.tree.map(lambda *parts: np.concatenate(list(map(host, parts))), *inputs)
    sizes = [int(np.shape(jax.tree.leaves(x)[0])[0]) for x in inputs]
    return joined, sizes, pairs


def _require_alike(inputs: list[Any]) -> None:
    """Raises a ValueError naming the first batch whose x differs from batch 0's but for
    its number of rows (each padded to its own longest sequence, say): they are joined."""

    def rows(x: Any) -> tuple[Any, ...]:
        return (str(jax.tree.structure(x)), *(np.shape(leaf)[1:] for leaf in jax.tree.leaves(x)))

    first = rows(inputs[0])
    for i, x in enumerate(inputs[1:], start=1):
        if rows(x) != first:
            raise ValueError(
                f"x: batch {i} of the source holds rows of shapes {rows(x)[1:]}, batch 0 "
                f"{first[1:]} (or their structures differ); predict joins the batches' rows "
                f"into one array: pad every batch to one length, or call fl.predict on each batch"
            )


def no_variables(given: Any) -> str:
    """Why `given` (None, or a State) holds no variables to predict with, and the fix."""
    if given is None:
        return "variables_or_state=None: pass the trained variables, or the State a run returned"
    step_state = getattr(given, "step_state", None)
    if step_state is None:
        return (
            "variables_or_state: the State holds no step state (an iteration handler's "
            "State in a fused run, or an observer's after a dispatch of several epochs); "
            "predict with the State the run returned"
        )
    return (
        f"variables_or_state: fl.predict reads the model's variables from "
        f"step_state['params'], and this State's step state is {without_params(step_state)}"
        f": pass the variables themselves, fl.predict(model, state.step_state[...], x), or "
        f"keep them under step_state['params'], as fl.trainer does"
    )
