"""Whether the data fits the model: x fits the model, y fits its output and the loss.

Checked once per run on the first batch, abstractly (`jax.eval_shape`: nothing runs on the
device), so a shape mistake is a clear error before anything compiles rather than a raw
message from inside flax or jax.
"""

from __future__ import annotations

import re
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np

from ._batch_checks import no_device_dtype
from ._epoch_order import abstract_key
from ._label_rule import LabelRule
from ._metrics import fits_output, resolve_loss
from ._model_code import kept_as_raised, model_code_error, model_error, raise_from
from ._model_fit_advice import (
    describe,
    first_line,
    fix_for_x,
    held,
    loss_misfit,
    loss_misfit_error,
    one_example,
    refuse_one_class_output,
    scope_misuse,
    unbound_axis,
)
from ._outputs import NoTargetsError, require_one_prediction
from ._outputs_at import model_outputs_at, outputs_at
from ._placement import device_dtype
from ._rng_advice import rng_error
from ._target_shapes import CrossBroadcastError
from ._unbatched import refuse_broadcast_over_examples, unbatched_output
from ._variables_diff import first_difference, names_the_form, same_signature, warn_unread
from .models import ModelConventionError

__all__ = ["ModelFit", "SPARSE", "abstract", "needs_rng"]

SPARSE = "sparse_categorical_cross_entropy"
_BINARY = "binary_cross_entropy"
_SAME_SHAPE_LOSSES = ("categorical_cross_entropy",)
_SAME_SIZE_LOSSES = ("mean_squared_error", "mean_absolute_error", _BINARY)


def abstract(leaf: Any) -> Any:
    """The ShapeDtypeStruct the device sees for a host leaf (float64 becomes float32)."""
    if isinstance(leaf, (int, float, bool, complex)):
        return leaf
    return jax.ShapeDtypeStruct(np.shape(leaf), device_dtype(leaf))


FRESH = "freshly initialized variables"
_UNKNOWN: Any = object()  # model.init could not be evaluated abstractly (or was not tried)

# What a model that asks for randomness fuseloop does not supply raises: flax.linen's
# InvalidRngError ('... needs PRNG for "noise"'), nnx's "no `rngs` argument was provided to
# Dropout" or "No RngStream named 'noise'", a module that "requires a key".
_RNG_WORDS = re.compile(
    r"\b(p?rngs?|rng_\w+|make_rng|rngstream|prngkey)\b"
    r"|\b(requires|needs) an? (random |prng )?key\b",
    re.IGNORECASE,
)


def _errors(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or while handling."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def needs_rng(error: BaseException) -> bool:
    """Whether `error` is a model's complaint about a random key or rng stream it lacks.

    Example:
        >>> needs_rng(ValueError("no `rngs` argument was provided to Dropout"))
        True
        >>> needs_rng(TypeError("dot_general requires contracting dimensions to match"))
        False
    """
    return any(
        isinstance(e, flax.errors.InvalidRngError) or _RNG_WORDS.search(str(e))
        for e in _errors(error)
    )


class ModelFit:
    """The abstract checks of one run's program against its first batch.

    After `check_first`, `first_x` is `(x, its abstract value)`, `first_y` y's abstract value and
    `labels` what a named loss's labels must hold (a sparse cross-entropy's class count from the
    model's output width, a binary cross-entropy's [0, 1]), for the host's label checks. `fresh`
    holds the abstract variables `model.init` makes for that batch, and `checked` whether x, y and
    the loss passed with them; when they did not (an evaluator's init, which the run never calls,
    may return anything; fresh variables that the model rejects may be replaced by given ones),
    `check_run_variables` checks x, y and the loss with the variables the run starts from, which
    decide. `argument` and `inputs` name, for messages, the caller's argument that gave the
    variables and the one that gave x.
    """

    def __init__(self, program: Any, argument: str = "init_state", inputs: str = "data: x"):
        self.program = program
        self.argument = argument
        self.inputs = inputs
        self.first_x: tuple[Any, Any] | None = None
        self.first_y: Any = None
        self.labels: LabelRule | None = None
        self.fresh: Any = _UNKNOWN
        self.checked = False

    def verdict(self) -> tuple[Any, ...]:
        """What `check_first` found, for `restore` on a later batch of the same signature."""
        return self.first_x, self.first_y, self.labels, self.fresh, self.checked

    def restore(self, verdict: tuple[Any, ...]) -> None:
        self.first_x, self.first_y, self.labels, self.fresh, self.checked = verdict

    def _forward(self, variables: Any, traced: bool = False) -> Any:
        """The model's abstract output on the first batch's x with abstract `variables`
        (`traced`: the call's ClosedJaxpr instead, x its first input)."""
        if self.first_x is None:
            raise RuntimeError("check_variables: no batch has been seen yet (internal error)")
        model, xs = self.program.model, self.first_x[1]
        train = self.program.kind == "trainer"

        def forward(x: Any, variables: Any, key: Any) -> Any:
            return model.forward(variables, x, train=train, rng=key if train else None)[0]

        args = (xs, variables, abstract_key())
        return jax.make_jaxpr(forward)(*args) if traced else jax.eval_shape(forward, *args)

    def check_variables(self, variables: Any, whose: str) -> Any:
        """The model's abstract output on the first batch's x with `variables` (abstract
        too); a failure is a ValueError naming x's shapes and `whose` variables they were
        (or, where the model asked for randomness or the variables hold no arrays, that)."""
        try:
            return self._forward(variables)
        except ModelConventionError:
            raise
        except Exception as error:  # noqa: BLE001 - re-raised with context
            raise_from(self._misfit(error, variables, whose), error)

    def check_run_variables(self, variables: Any) -> None:
        """x - and, unless `check_first` checked them with fresh variables, y and the loss -
        against the (abstract) variables the run starts from: the caller's, or the trainer's
        own init. Fresh variables of the same signature as those `check_first` passed are
        not traced again."""
        fresh = self.fresh is not _UNKNOWN and same_signature(variables, self.fresh)
        if not fresh and self.checked and self.program.kind == "trainer":  # fresh ones fit
            warn_unread(variables, self.fresh)
        if self.checked:
            if not fresh:
                self.check_variables(variables, "the given variables")
            return
        if self.program.kind == "evaluator":  # it never initializes: the caller's
            whose = "the given variables"
        elif fresh:
            whose = FRESH
        elif self.fresh is not _UNKNOWN:
            whose = "the given variables"
        else:
            whose = "the variables the run starts from"
        y_pred = self.check_variables(variables, whose)
        if self.program.loss is not None and self.first_y is not None:
            self._check_loss(self.first_y, y_pred, self.first_y, variables)

    def _misfit(self, error: BaseException, variables: Any, whose: str) -> BaseException:
        """The ValueError (or the model's own error, kept) where the first batch's x fails."""
        x = self.first_x[0] if self.first_x is not None else None
        applying = f"applying the model to the first batch's x ({describe(x, 'x')})"
        if needs_rng(error):
            return rng_error(self.program, error, applying)
        fresh, training = whose == FRESH, self.program.kind == "trainer"
        advice = unbound_axis(error, applying) or scope_misuse(error, applying, fresh, training)
        advice = advice or model_code_error(error, applying, x)
        if advice is not None:
            return advice
        if not jax.tree.leaves(variables):
            if whose == FRESH:
                return ValueError(
                    f"model: its init returned {held(variables)}, no variables, so {applying} "
                    f"fails with {first_line(error)}; x is not the problem. Make init return "
                    f"the variables the model's apply reads, or pass trained variables to run: "
                    f"fl.evaluator(model).run(data, params), or trainer.run(data, variables)"
                )
            return ValueError(
                f"{self.argument}: {whose} hold no arrays ({held(variables)}), so {applying} "
                f"fails with {first_line(error)}. Pass the variables the model reads (e.g. a "
                f"trained State's params)"
            )
        if whose != FRESH and self.checked and self.fresh is not _UNKNOWN:
            difference = first_difference(variables, self.fresh)
            if names_the_form(difference):  # not x's doing, whatever the model says
                return ValueError(
                    f"{self.argument}:{difference} ({applying} with them fails with "
                    f"{first_line(error)})"
                )
            single = one_example(self.inputs, self.first_x, self.program.model, variables)
            if single is not None:
                return single
            return ValueError(
                f"{self.inputs} does not fit the model with {whose} ({self.argument}): "
                f"{applying} with them fails with {first_line(error)}, while the model's own "
                f"fresh variables fit this x.{difference} Either x "
                f"is shaped unlike the data those variables were trained on, or they come "
                f"from another model (a State saved from a different one?): pass x shaped "
                f"as in training, or variables of this model"
            )
        return kept_as_raised(error, applying) or ValueError(
            f"{self.inputs} does not fit the model: applying it with {whose} to the first "
            f"batch's x ({describe(x, 'x')}) fails with {first_line(error)}. "
            f"{fix_for_x(x, error, self.program.model)}, or pass matching variables"
        )

    def check_first(self, batch: Any) -> None:
        """x fits the model and y fits its output and the loss (abstractly, nothing runs).

        Checked with the variables `model.init` makes; where those cannot be made, or the
        model rejects them, `check_run_variables` checks with the run's variables instead
        (a model that asks for randomness fuseloop does not supply fails here)."""
        model, x, y = self.program.model, batch[0], batch[1]
        if model is None:
            return
        # Before anything is traced: JAX's own error would name only the dtype.
        wrong = no_device_dtype(x, "x", "the model")
        if wrong is None and not isinstance(self.program.loss, str):  # a named loss's rule
            wrong = no_device_dtype(y, "y", "the step")  # says more of its labels' strings
        if wrong is not None:  # `inputs` is "data: x" in a run, "x" in fl.predict
            raise ValueError(f"{self.inputs.removesuffix('x')}{wrong}")
        self.first_x = (x, jax.tree.map(abstract, x))
        self.first_y = jax.tree.map(abstract, y)
        try:
            variables = jax.eval_shape(model.init, abstract_key(), self.first_x[1])
        except ModelConventionError:
            raise
        except Exception as error:  # noqa: BLE001 - re-raised with context below
            if self.program.kind == "evaluator" or isinstance(error, jax.errors.JAXTypeError):
                # An evaluator never initializes (its variables come from the caller), and
                # an init that needs concrete values cannot be checked abstractly.
                return
            if needs_rng(error):
                raise rng_error(
                    self.program,
                    error,
                    f"initializing the model on the first batch's x ({describe(x, 'x')})",
                ) from error
            initializing = f"initializing it on the first batch's x ({describe(x, 'x')})"
            problem = model_error(error, initializing, x) or ValueError(
                f"data: x does not fit the model: {initializing} fails with {first_line(error)}. "
                f"{fix_for_x(x, error, self.program.model)}"
            )
            raise_from(problem, error)
        self.fresh = variables
        try:
            y_pred = self._forward(variables)
        except ModelConventionError:
            raise
        except Exception as error:  # noqa: BLE001 - a missing rng is the model's alone
            if needs_rng(error):
                raise self._misfit(error, variables, FRESH) from error
            return  # the run's variables decide (check_run_variables)
        if self.program.loss is not None:
            self._check_loss(y, y_pred, self.first_y, variables)
        self.checked = True

    def _check_loss(self, y: Any, y_pred: Any, ys: Any, variables: Any) -> None:
        try:
            xs = self.first_x[1] if self.first_x is not None else None
            with model_outputs_at(outputs_at(self.program.model, variables, xs)):
                self._fit_loss(y, y_pred, ys)
        except ValueError as error:  # a model that read x's examples as one example's?
            # y against the output, or a cross broadcast, not the loss's own error
            fitting = str(error).startswith("data: ") or isinstance(error, CrossBroadcastError)
            unbatched = unbatched_output(self.first_x, y_pred) if fitting else None
            if unbatched is None:
                raise
            raise unbatched from error
        if not isinstance(self.program.loss, str):  # a built-in loss's checks refuse it
            x_flow = lambda: self._forward(variables, traced=True)  # noqa: E731 - if asked
            refuse_broadcast_over_examples(self.first_x, ys, y_pred, self.program.loss, x_flow)

    def _fit_loss(self, y: Any, y_pred: Any, ys: Any) -> None:
        name, loss_fn = resolve_loss(self.program.loss)
        if isinstance(self.program.loss, str):  # a built-in loss reads one array
            require_one_prediction(y_pred, "loss", name)
        shape = getattr(y_pred, "shape", None)
        output = (
            f"the model's output of shape {shape}"
            if shape is not None
            else f"the model's output ({describe(y_pred, 'output')})"
        )
        abstract_pair = all(isinstance(v, jax.ShapeDtypeStruct) for v in (ys, y_pred))
        if abstract_pair and isinstance(self.program.loss, str):  # not a callable's __name__
            self._check_named_loss(name, ys, y_pred, output)
        try:
            value = jax.eval_shape(loss_fn, ys, y_pred)
        except NoTargetsError:
            raise
        except Exception as error:  # noqa: BLE001
            if not loss_misfit(error, y, y_pred):  # the loss's own fault, not y's: its own error
                error.add_note(
                    f"fuseloop: raised by the loss {name!r} on the first batch, with y "
                    f"({describe(y, 'y')}) and {output}"
                )
                raise
            wrong = no_device_dtype(y, "y", f"the loss {name!r}")
            if wrong is not None:
                raise ValueError(f"data: {wrong}") from error
            raise loss_misfit_error(error, name, y, output, self.program.loss) from error
        if not isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(
                f"loss {name!r} returned {type(value).__name__} "
                f"({describe(value, 'loss')}) for the first batch; a loss must return a "
                f"scalar array, not a tuple or dict (return the loss alone; for auxiliary "
                f"outputs write the step with fl.loop)"
            )
        if value.shape != ():
            raise ValueError(
                f"loss {name!r} returned shape {value.shape} for the first batch; a loss "
                f"must return a scalar (reduce it, e.g. with .mean())"
            )

    def _check_named_loss(self, name: str, ys: Any, y_pred: Any, output: str) -> None:
        shape = ys.shape
        refuse_one_class_output(name, y_pred, output)
        if name == SPARSE and jnp.issubdtype(ys.dtype, jnp.floating):
            fix = "for one-hot targets use 'categorical_cross_entropy'"
            if shape != y_pred.shape:  # else y has the output's shape: one-hot targets
                fix = f"Cast them (y.astype(np.int32)) once NaN labels are dropped, or {fix}"
            raise ValueError(
                f"data: y holds floats ({ys.dtype} on the device), but {name} expects integer "
                f"class labels; a float label would be truncated to a class: {fix}"
            )
        if name == SPARSE:
            accepted = (y_pred.shape[:-1], y_pred.shape[:-1] + (1,))
            if shape not in accepted:
                raise ValueError(
                    f"data: y has shape {shape}, but {name} with {output} expects integer "
                    f"class labels of shape {accepted[0]} (or {accepted[1]}); for one-hot "
                    f"targets use 'categorical_cross_entropy'"
                )
            self.labels = LabelRule(name, int(y_pred.shape[-1]))
        elif name in _SAME_SHAPE_LOSSES and shape != y_pred.shape:
            raise ValueError(
                f"data: y has shape {shape}, but {name} with {output} expects targets of the "
                f"same shape {y_pred.shape} (one-hot or probabilities); for integer labels "
                f"use 'sparse_categorical_cross_entropy'"
            )
        elif name in _SAME_SIZE_LOSSES and not fits_output(shape, y_pred.shape):
            raise ValueError(
                f"data: y has shape {shape}, but {name} with {output} expects targets with "
                f"one value per output, shape {y_pred.shape} (trailing 1s aside); reshape "
                f"or transpose y, or change the model's last layer"
            )
        if name == _BINARY:
            self.labels = LabelRule(name)
