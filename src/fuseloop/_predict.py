"""`fl.predict`: evaluation-mode outputs for every example, in order, in fused chunks.

The examples are cut into batches of `batch_size` (a source's batches are kept as it
yields them), and `fuse` batches of one size at a time go to the device in one transfer,
where a `lax.map` runs the model on each. Each batch runs as it is: a short last batch is a
chunk of its own (one program more), never padded with rows a model reading its whole
batch would see. Outputs come back once per chunk.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import sys
import types
from typing import Any

import jax
import numpy as np

from ._arg_types import is_int, refuse_deleted_arrays
from ._data import is_python_number
from ._foreign_keywords import PREDICT_ADVICE, advise_foreign_keywords
from ._graph_batch import rows_of
from ._metrics import batch_size
from ._model_code import KEPT
from ._model_fit import ModelFit, abstract
from ._narrowing import Narrowing, native_order
from ._placement import on_one_device_set
from ._predict_inputs import host, inputs_of_source, no_variables
from ._predict_outputs import LIST_READ, joined, require_rows, require_rows_follow
from ._unsliceable import refuse_unsliceable
from ._variables_diff import member_axis
from .engine.conv_layout import named
from .models import as_model, variables_given

__all__ = ["predict"]

# (id(model), vmapped over members, x a list) -> [model, its adapter, jitted chunk
# program, a plain model object as that program traced it (`from_functions.snapshot`)]
_PROGRAMS: dict[tuple[int, bool, bool], list[Any]] = {}
_MAX_PROGRAMS = 16
_DEFAULT_CHUNK = 32


def _chunk_program(model: Any, members: bool = False, listed: bool = False) -> tuple[Any, Any]:
    """One jitted program per model (kept alive with it), so a second call reuses it, and
    the model's adapter. `members`: vmapped over a population's leading member axis;
    `listed`: x was given as a list (named in a misfit's message).

    An nnx module changed in place since (a static attribute, a layer of another shape),
    or a plain object with an attribute set since the last call, gets a new program:
    predict takes the model as it is at each call.
    """
    key = (id(model), members, listed)  # `listed` is traced into the misfit's message
    cached = _PROGRAMS.get(key)
    if cached is not None and cached[0] is model and _unchanged(cached[1], cached[3]):
        return cached[2], cached[1]
    adapter = as_model(model)
    entry = [model, adapter, None, None]

    def run_chunk(variables: Any, chunk: Any) -> Any:
        def one(x: Any) -> Any:
            out = adapter.forward(variables, x, train=False, rng=None)[0]
            require_rows(out, batch_size(x), listed)
            require_rows_follow(adapter, variables, x, out, listed)
            if hasattr(adapter, "snapshot"):  # a plain object, as this trace left it
                entry[3] = adapter.snapshot()
            return out

        return jax.lax.map(one, chunk)

    program = jax.jit(
        named(jax.vmap(run_chunk, in_axes=(0, None)), "predict_members")
        if members
        else named(run_chunk, "predict")
    )
    _PROGRAMS.pop(key, None)
    if len(_PROGRAMS) >= _MAX_PROGRAMS:
        _PROGRAMS.pop(next(iter(_PROGRAMS)))
    entry[2] = program
    _PROGRAMS[key] = entry
    return program, adapter


def _unchanged(adapter: Any, seen: Any) -> bool:
    """Whether the programs traced with `adapter` still fit its model (an nnx module's
    structure, a plain object's attributes as `seen`; linen and equinox modules cannot
    change)."""
    try:
        for check, args in (("check_structure", ()), ("check_unchanged", (seen,))):
            if hasattr(adapter, check):
                getattr(adapter, check)(*args)
    except ValueError:
        return False
    return True


def _is_array(value: Any) -> bool:
    return (
        isinstance(value, (np.ndarray, jax.Array))
        or hasattr(value, "__array__")
        and (hasattr(value, "shape"))
    )


def _is_array_tree(x: Any) -> bool:
    if isinstance(x, (list, collections.abc.Iterator)) or callable(x) or hasattr(x, "iter_epoch"):
        return False
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(_is_array(leaf) and np.ndim(leaf) >= 1 for leaf in leaves)


_TUPLE_READ = (
    "fuseloop: each batch was a tuple of {n} items, all read as x (the inputs of a model "
    "of several); predict reads a batch as x or as a pair (x, y). For Keras's (x, y, "
    "sample_weight) batches, give predict the x alone (e.g. [b[0] for b in batches])"
)
_PAIRS_READ = (
    "fuseloop: each batch of the source was a pair, read as (x, y): only its first item "
    "went to the model. For an x made of two arrays, yield ((a, b), None) or a dict of "
    "arrays instead"
)


def _local(leaf: Any) -> Any:
    """A leaf this process can place: after a run over several processes the params span
    every process's devices, each holding them whole (replicated); predict runs here."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return leaf
    if leaf.is_fully_replicated:
        return leaf.addressable_data(0)
    raise ValueError(
        f"variables_or_state: a leaf of shape {leaf.shape} is split over the processes' "
        f"devices, and predict runs on this process's devices; gather it first, e.g. "
        f"jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)"
    )


def _example_count(x: Any, joined: bool = False) -> int:
    """Rows along axis 0, which every leaf shares (`joined`: the batches given were
    concatenated first, so the rows named are their sums)."""
    flat = jax.tree_util.tree_flatten_with_path(x)[0]
    sizes = {int(np.shape(leaf)[0]) for _, leaf in flat}
    if len(sizes) != 1:
        raise ValueError(
            f"x: its arrays hold different numbers of rows ({rows_of(x)}"
            f"{', over all the batches given' if joined else ''}); fl.predict returns one "
            f"output row per example, so every leaf of x needs one row per example along "
            f"axis 0: slice them to the same number of examples. Where a leaf holds other "
            f"rows by design (a graph batch's nodes and edges), predict cannot tell the "
            f"examples apart: call the model on each batch instead, e.g. "
            f"jax.jit(model.apply)(params, x)"
        )
    return sizes.pop()


def _chunk_size(fuse: Any) -> int:
    if fuse is True:
        return _DEFAULT_CHUNK
    if fuse is False:
        return 1
    if is_int(fuse) and fuse >= 1:
        return int(fuse)
    raise ValueError(f"fuse={fuse!r} must be True, False or a positive int (batches per chunk)")


def _device_inputs(inputs: Any) -> Any:
    """`inputs` as numpy arrays the device takes, checked as a trainer's run checks its
    batches (`_narrowing.py`), since predict feeds the same device: a big-endian leaf is
    converted (as `fl.data.arrays` converts it), a float64 one warned of and cast to
    float32, and a 64-bit integer beyond 32 bits refused, as it would wrap around
    (64-bit mode off). The values are read only for 64-bit integer leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
    names = ["x" + jax.tree_util.keystr(path) for path, _ in flat]
    leaves = [native_order(host(leaf)) for _, leaf in flat]
    narrowing = Narrowing()  # one per call, as one per run: the float64 warning once
    narrowing.warn_float64(names, leaves, source="fl.predict")
    narrowing.check_ints(names, leaves, "", source="fl.predict")
    return jax.tree.unflatten(treedef, [_narrowed_float(leaf) for leaf in leaves])


def _narrowed_float(array: np.ndarray) -> np.ndarray:
    """float64 as float32 where 64-bit mode is off: a chunk is built on the host, so it is
    cast here rather than on its way to the device (half the bytes to move)."""
    if array.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        return array.astype(np.float32)
    return array


def _batch_sizes(n: int, batch_size: int) -> list[int]:
    """Batches of `batch_size` examples over `n`, the last one short where they do not
    divide."""
    return [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])


def _chunks(x: Any, sizes: list[int], per_chunk: int) -> Any:
    """Yields host chunks `(batches, batch rows, ...)` of the consecutive batches of one
    size, and the examples each holds. Every batch runs as it is, its rows alone (a model
    whose outputs depend on the batch's other rows, an in-batch normalisation, sees no
    padding): a short last batch is a chunk of its own. A chunk of fewer batches than
    `per_chunk` is filled with batches of zeros up to the power of two that holds them
    (so a few sizes of input compile a few programs, and 300 examples are not padded to
    32 batches of 256); those are run apart, and their outputs dropped."""
    start = 0
    sized = (size for size in sizes if size)  # an empty batch: no rows
    for size, count in ((size, len(list(run))) for size, run in itertools.groupby(sized)):
        held = min(per_chunk, 1 << (count - 1).bit_length())
        for first in range(0, count, held):
            rows = min(held, count - first) * size
            cut = functools.partial(_batches, start=start, rows=rows, batches=(held, size))
            yield jax.tree.map(cut, x), rows
            start += rows


def _batches(leaf: np.ndarray, start: int, rows: int, batches: tuple[int, int]) -> np.ndarray:
    """`rows` rows of `leaf` from `start` as `batches` (how many, of how many rows), the
    batches after them zeros."""
    held, size = batches
    padded = np.zeros((held * size,) + leaf.shape[1:], leaf.dtype)
    padded[:rows] = leaf[start : start + rows]
    return padded.reshape((held, size) + leaf.shape[1:])


def _equinox(model: Any) -> Any:
    """`model`'s adapter where it is an equinox module (whose fields that are not trained a
    module given as the variables must share), else None."""
    eqx = sys.modules.get("equinox")
    return as_model(model) if eqx is not None and isinstance(model, eqx.Module) else None


@advise_foreign_keywords(PREDICT_ADVICE)
def predict(
    model: Any, variables_or_state: Any, x: Any, *, batch_size: int = 256, fuse: bool | int = True
) -> Any:
    """The model's evaluation-mode outputs for every example of `x`, in order.

    Args:
        model: The model (as given to the trainer).
        variables_or_state: Trained variables, the State a run returned, or an nnx or
            equinox module built with the weights to use.
        x: Inputs with the examples on axis 0 (an array or a pytree of arrays), or a batch
            source (a list of batches, a finite iterator, a callable) yielding inputs or `(x, y)`
            pairs, whose batches are kept in their order. An `fl.data.arrays` source gives
            its x arrays: every example in their order, neither shuffled nor dropped.
        batch_size: Examples per batch for array inputs (a source's batches are run as it
            yields them). A short last batch is included, run as it is: a model whose
            outputs read the batch's other rows sees only its real examples.
        fuse: Batches per device call: True (32), False (one), or a positive int.

    Returns:
        A numpy array of outputs (or the model's output pytree of numpy arrays), one row per
        example. For a population's State (`run(..., population=N)`), each output has a
        leading member axis of size N: the ensemble's predictions.

    Example:
        >>> import fuseloop as fl, jax, numpy as np
        >>> model = fl.models.mlp([4, 2])
        >>> variables = model.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
        >>> predict(model, variables, np.zeros((10, 3), np.float32), batch_size=4).shape
        (10, 2)
    """
    variables = variables_given(variables_or_state, "variables_or_state", _equinox(model))
    if variables is None:
        raise ValueError(no_variables(variables_or_state))
    refuse_deleted_arrays(variables, "variables_or_state")
    _require_examples_axis(x)
    per_chunk = _chunk_size(fuse)
    # A list of arrays may have meant the inputs of a model of several (not of batches).
    listed = isinstance(x, list) and all(map(_is_array, x))
    if _is_array_tree(x):
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        sizes: int | list[int]
        inputs, sizes, pairs = x, int(batch_size), False
    else:
        try:
            inputs, sizes, pairs = inputs_of_source(x)  # each batch checked as it is read
        except ValueError as error:  # batches of other shapes: a model's several inputs?
            if listed:
                error.add_note(LIST_READ)
            raise
    inputs = _device_inputs(inputs)
    n = _example_count(inputs, joined=not _is_array_tree(x))
    if n == 0:
        raise ValueError("x holds no examples; there is nothing to predict")
    batches = _batch_sizes(n, sizes) if isinstance(sizes, int) else sizes  # arrays: cut here
    members = getattr(variables_or_state, "population", None) is not None
    program, adapter = _chunk_program(model, members, listed=listed)
    lead = 1 if members else 0  # a population's outputs keep the member axis first
    outputs: list[Any] = []
    # Moved explicitly, as a run moves its batches: allowed under a transfer guard.
    variables = on_one_device_set(jax.device_put(jax.tree.map(_local, variables)))
    for chunk, live in _chunks(inputs, batches, per_chunk):
        try:
            result = program(variables, jax.device_put(chunk))
        except Exception as error:
            if not outputs:  # the first chunk traces the model: say whether x misfits
                batched = not _is_array_tree(x)  # a source (or a list) of batches
                read = (pairs, batched, listed)
                _explain_misfit(model, variables, chunk, read, members, error)
                if pairs:  # the model took the first items, and failed later (its outputs)
                    error.add_note(_PAIRS_READ)
            raise
        # Host sync: the chunk's outputs come back to the host (one read per chunk).
        host = jax.device_get(result)
        outputs.append(jax.tree.map(lambda a, live=live: _rows(a, lead, live), host))
    return joined(outputs, lead)


def _require_examples_axis(x: Any) -> None:
    """Raises a ValueError for an `x` that cannot hold examples: None, or a scalar."""
    if x is None:
        raise ValueError("x=None: pass the inputs, an array with the examples on axis 0")
    if isinstance(x, collections.abc.Iterator):  # its batches are checked once read
        return
    refuse_unsliceable(x, "x")
    if _is_array(x) and np.ndim(x) == 0:
        raise ValueError(
            f"x: a scalar ({type(x).__name__} of shape ()) holds no examples; pass an array "
            f"with the examples on axis 0, e.g. x[None] for a single example"
        )
    if isinstance(x, (dict, tuple)):  # inputs, unless a leaf holds no examples at all
        leaves = jax.tree_util.tree_flatten_with_path(x)[0]
        numbers = [
            (path, leaf) for path, leaf in leaves if _is_array(leaf) or is_python_number(leaf)
        ]
        scalar = next((path for path, leaf in numbers if np.ndim(leaf) == 0), None)
        if scalar is not None and len(numbers) == len(leaves) > 1:
            raise ValueError(
                f"x{jax.tree_util.keystr(scalar)} is a scalar (shape ()), while every input "
                f"of x needs the examples on axis 0: give it one value per example "
                f"(np.full(n, value)), or let the model hold a value shared by all of them"
            )


def _explain_misfit(
    model: Any,
    variables: Any,
    chunk: Any,
    read: tuple[bool, bool, bool],
    members: bool,
    raised: BaseException,
) -> None:
    """Raises the trainer's ValueError where the chunk's x does not fit the model with
    `variables` (a population's first member's), noting how x was read (`read`: pairs read
    as (x, y), a source of batches, a list of arrays); returns when the check finds nothing,
    or the model's own error kept as raised: then `raised`, the program's, is noted."""
    pairs, batched, listed = read
    try:
        _check_fit(model, variables, chunk, members)
        return
    except Exception as error:  # noqa: BLE001 - the check's, or the model's own met again
        noted: BaseException = error
        kept = [n for n in getattr(error, "__notes__", []) if n.startswith(KEPT)]
        if kept and type(error) is type(raised):  # the model's own: the one raised, noted
            noted = raised
            raised.add_note(kept[-1])
        elif not isinstance(error, ValueError):
            raise
    if pairs and noted is not raised:  # the caller notes its own error
        noted.add_note(_PAIRS_READ)
    if batched and isinstance(chunk, (tuple, list)) and len(chunk) > 2:
        noted.add_note(_TUPLE_READ.format(n=len(chunk)))
    elif listed:
        noted.add_note(LIST_READ)
    if noted is not raised:
        raise noted


def _check_fit(model: Any, variables: Any, chunk: Any, members: bool) -> None:
    program = types.SimpleNamespace(kind="evaluator", model=as_model(model), loss=None)
    fit = ModelFit(program, argument="variables_or_state", inputs="x")
    if members:
        variables = jax.tree.map(lambda leaf: leaf[0], variables)
    fit.check_first((jax.tree.map(lambda leaf: leaf[0], chunk), None))
    size = None if members else member_axis(variables, fit.fresh)
    if size is not None:
        raise ValueError(
            f"variables_or_state: these variables have a leading axis of {size} over the "
            f"model's own (a population's params, one per member); pass the population's "
            f"State itself (every member predicts), or state.member(i) for one member"
        )
    fit.check_run_variables(jax.tree.map(abstract, variables))


def _rows(a: np.ndarray, lead: int, live: int) -> np.ndarray:
    """A chunk's outputs `(members?, chunks, batch, rest...)` as `(members?, examples,
    rest...)`, the padding dropped."""
    flat = a.reshape(a.shape[:lead] + (-1,) + a.shape[lead + 2 :])
    return flat[(slice(None),) * lead + (slice(0, live),)]
