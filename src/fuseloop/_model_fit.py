"""Whether the data fits the model: x fits the model, y fits its output and the loss.

Checked once per run on the first batch, abstractly (`jax.eval_shape`: nothing runs on the
device), so a shape mistake is a clear error before anything compiles rather than a raw
message from inside flax or jax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._metrics import resolve_loss
from ._placement import device_dtype
from .models import ModelModeError

__all__ = ["ModelFit", "SPARSE", "abstract", "check_step_keeps_state"]

SPARSE = "sparse_categorical_cross_entropy"
_SAME_SHAPE_LOSSES = ("categorical_cross_entropy",)
_SAME_SIZE_LOSSES = ("mean_squared_error", "mean_absolute_error", "binary_cross_entropy")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0].rstrip('.') if text else ''}"


def _describe(tree: Any, name: str) -> str:
    parts = [f"{leaf} of shape {shape}" for leaf, shape in _named_shapes(tree, name)]
    return ", ".join(parts) if parts else "no arrays"


def _named_shapes(tree: Any, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(prefix + jax.tree_util.keystr(path), tuple(np.shape(leaf))) for path, leaf in flat]


def abstract(leaf: Any) -> Any:
    """The ShapeDtypeStruct the device sees for a host leaf (float64 becomes float32)."""
    if isinstance(leaf, (int, float, bool, complex)):
        return leaf
    return jax.ShapeDtypeStruct(np.shape(leaf), device_dtype(leaf))


class ModelFit:
    """The abstract checks of one run's program against its first batch.

    After `check_first`, `first_x` is `(x, its abstract value)` and `classes` the model's
    output width when the loss is a sparse cross-entropy (for the host's label checks).
    """

    def __init__(self, program: Any):
        self.program = program
        self.first_x: tuple[Any, Any] | None = None
        self.classes: int | None = None

    def check_variables(self, variables: Any, whose: str) -> Any:
        """The model's abstract output on the first batch's x with `variables` (abstract
        too); a failure is a ValueError naming x's shapes and `whose` variables they were."""
        if self.first_x is None:
            raise RuntimeError("check_variables: no batch has been seen yet (internal error)")
        model, (x, xs) = self.program.model, self.first_x
        train = self.program.kind == "trainer"
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)

        def forward(variables: Any, x: Any, key: Any) -> Any:
            return model.forward(variables, x, train=train, rng=key if train else None)[0]

        try:
            return jax.eval_shape(forward, variables, xs, key)
        except ModelModeError:
            raise
        except Exception as error:  # noqa: BLE001 - re-raised with context
            raise ValueError(
                f"data: x does not fit the model: applying it with {whose} to the first "
                f"batch's x ({_describe(x, 'x')}) fails with {_first_line(error)}. Give x the "
                f"shape the model expects (the batch axis first), or pass matching variables"
            ) from error

    def check_first(self, batch: Any) -> None:
        """x fits the model and y fits its output and the loss (abstractly, nothing runs)."""
        model, x, y = self.program.model, batch[0], batch[1]
        if model is None:
            return
        self.first_x = (x, jax.tree.map(abstract, x))
        try:
            variables = jax.eval_shape(
                model.init, jax.ShapeDtypeStruct((2,), jnp.uint32), self.first_x[1]
            )
        except ModelModeError:
            raise
        except Exception as error:  # noqa: BLE001 - re-raised with context below
            if self.program.kind == "evaluator" or isinstance(error, jax.errors.JAXTypeError):
                # An evaluator never initializes (its variables come from the caller), and
                # an init that needs concrete values cannot be checked abstractly.
                return
            raise ValueError(
                f"data: x does not fit the model: initializing it on the first batch's x "
                f"({_describe(x, 'x')}) fails with {_first_line(error)}. Give x the shape the "
                f"model expects (the batch axis first)"
            ) from error
        y_pred = self.check_variables(variables, "freshly initialized variables")
        if self.program.loss is not None:
            self._check_loss(y, y_pred, jax.tree.map(abstract, y))

    def _check_loss(self, y: Any, y_pred: Any, ys: Any) -> None:
        name, loss_fn = resolve_loss(self.program.loss)
        shape = getattr(y_pred, "shape", None)
        output = (
            f"the model's output of shape {shape}"
            if shape is not None
            else f"the model's output ({_describe(y_pred, 'output')})"
        )
        if isinstance(ys, jax.ShapeDtypeStruct) and isinstance(y_pred, jax.ShapeDtypeStruct):
            self._check_named_loss(name, ys, y_pred, output)
        try:
            value = jax.eval_shape(loss_fn, ys, y_pred)
        except Exception as error:  # noqa: BLE001
            raise ValueError(
                f"data: y does not fit the loss {name!r}: with y ({_describe(y, 'y')}) and "
                f"{output} it fails with {_first_line(error)}. Give y the shape the loss "
                f"expects for this output"
            ) from error
        if getattr(value, "shape", ()) != ():
            raise ValueError(
                f"loss {name!r} returned shape {value.shape} for the first batch; a loss "
                f"must return a scalar (reduce it, e.g. with .mean())"
            )

    def _check_named_loss(self, name: str, ys: Any, y_pred: Any, output: str) -> None:
        batch_size, shape = y_pred.shape[:1], ys.shape
        if name == SPARSE and jnp.issubdtype(ys.dtype, jnp.floating):
            raise ValueError(
                f"data: y has dtype {ys.dtype}, but {name} expects integer class labels; a "
                f"float label would be truncated to a class. Cast them (y.astype(np.int32)), "
                f"or for one-hot or probability targets use 'categorical_cross_entropy'"
            )
        if name == SPARSE:
            accepted = (y_pred.shape[:-1], y_pred.shape[:-1] + (1,))
            if shape not in accepted:
                raise ValueError(
                    f"data: y has shape {shape}, but {name} with {output} expects integer "
                    f"class labels of shape {accepted[0]} (or {accepted[1]}); for one-hot "
                    f"targets use 'categorical_cross_entropy'"
                )
            self.classes = int(y_pred.shape[-1])
        elif name in _SAME_SHAPE_LOSSES and shape != y_pred.shape:
            raise ValueError(
                f"data: y has shape {shape}, but {name} with {output} expects targets of the "
                f"same shape {y_pred.shape} (one-hot or probabilities); for integer labels "
                f"use 'sparse_categorical_cross_entropy'"
            )
        elif name in _SAME_SIZE_LOSSES and (
            shape[:1] != batch_size or int(np.prod(shape)) != int(np.prod(y_pred.shape))
        ):
            raise ValueError(
                f"data: y has shape {shape}, but {name} with {output} expects targets with "
                f"one value per output, shape {y_pred.shape}; reshape y or change the "
                f"model's last layer"
            )


def _state_leaf(leaf: Any) -> Any:
    """The abstract value of a step-state leaf as the device loop carries it."""
    return jax.ShapeDtypeStruct(
        np.shape(leaf), jax.dtypes.canonicalize_dtype(jnp.result_type(leaf))
    )


def check_step_keeps_state(step: Any, step_state: Any, batch: Any) -> None:
    """Raises a ValueError if one step changes the step state's structure, or a leaf's
    dtype or shape (found abstractly with `jax.eval_shape`: nothing runs or compiles).

    The fused and the unfused loop carry the step state through a device loop, which needs
    it unchanged; an optimizer state that promotes bfloat16 to float32 would otherwise fail
    deep inside JAX. A step that cannot be evaluated abstractly is left to the run itself.
    """
    try:
        before = jax.tree.map(_state_leaf, step_state)
        after = jax.eval_shape(lambda s, b: step(s, b)[0], before, jax.tree.map(abstract, batch))
    except Exception:  # noqa: BLE001 - the run raises its own, more specific error
        return
    old, old_def = jax.tree_util.tree_flatten_with_path(before)
    new, new_def = jax.tree_util.tree_flatten_with_path(after)
    expected: object = old_def  # this jaxlib has no stub for PyTreeDef: compare as objects
    if expected != new_def:
        raise ValueError(
            f"the step changes the structure of the step state: it starts as {old_def} and "
            f"one step returns {new_def}. A step must return a state with the same "
            f"structure, dtypes and shapes it was given"
        )
    for (path, a), (_, b) in zip(old, new, strict=True):
        if (a.shape, a.dtype) != (b.shape, jax.dtypes.canonicalize_dtype(b.dtype)):
            raise ValueError(
                f"the step changes step_state{jax.tree_util.keystr(path)} from dtype "
                f"{a.dtype} shape {a.shape} to dtype {b.dtype} shape {b.shape}; a step must "
                f"keep every leaf's dtype and shape (the loop carries the state through a "
                f"device loop). Cast the result back (e.g. .astype(old dtype)), or build the "
                f"state (e.g. the optimizer state) in the dtype the step produces"
            )
