"""The equinox adapter: a module applied per example, its inexact arrays as the params.

Re-exported from `fuseloop.models` (as `fl.models.from_equinox`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._functions import key_like, refuse_unpassed_key, required, takes_keyword
from ._linen import call_flags, flag_values, parameters_of
from ._metrics import batch_size
from ._mode_follow import run_following_modes, unrecognised_flags
from ._warn import warn

__all__ = ["from_equinox", "plain_module"]


def _equinox_stateful_layers(module: Any) -> list[str]:
    """Paths of equinox layers that keep state in an `eqx.nn.State` (BatchNorm, ...)."""
    import equinox as eqx

    stateful = (eqx.nn.StateIndex,)
    found = []
    leaves = jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda node: isinstance(node, stateful + (eqx.nn.BatchNorm,))
    )[0]
    for path, leaf in leaves:
        if isinstance(leaf, eqx.nn.BatchNorm):
            found.append(f"eqx.nn.BatchNorm at model{jax.tree_util.keystr(path)}")
        elif isinstance(leaf, stateful):
            found.append(f"eqx.nn.StateIndex at model{jax.tree_util.keystr(path)}")
    return found


# The key an evaluation passes to a module whose `__call__` requires `key`: fixed, and the
# same for every example, so an example's output depends on the example alone (not on its
# batch, its position in it, or the call), and no key has to be drawn per evaluation.
_INFERENCE_KEY_SEED = 0


def _requires_keyword(fn: Any, name: str) -> bool:
    """Whether `fn`'s signature has a parameter `name` without a default (False when its
    signature cannot be read)."""
    return required(parameters_of(fn).get(name))


def _refuse_other_key_names(cls: type) -> None:
    """A `__call__` parameter that reads as a PRNG key under another name than `key`
    (`rng`, `dropout_key`) would never receive one: the module would train without its
    dropout or noise."""
    for name, parameter in key_like(parameters_of(cls.__call__), 2, ("key",)):
        refuse_unpassed_key(
            parameter,
            f"model: {cls.__name__}.__call__'s parameter {name!r} reads as a PRNG key, but "
            f"fuseloop passes an equinox module its key as `key` only (one per example "
            f"while training, as equinox's layers take it): rename {name!r} to `key`",
        )


def plain_module(module: Any) -> Any:
    """`module` as an instance of its own class, where `trained` made it an evaluating
    subclass's, and so is every submodule `trained` made (a pretrained encoder reused in a
    larger model, whose subclass would pass it its evaluation flags while training); a copy
    where anything changed, else `module` itself: a State's params are the own class's
    pytree, so the adapter takes this one."""
    base = getattr(type(module), "_fuseloop_base", None)
    if base is not None:
        copy = object.__new__(base)
        for name, value in vars(module).items():
            object.__setattr__(copy, name, value)
        module = copy
    nested = jax.tree.leaves(module, is_leaf=_made_by_trained)
    if not any(_made_by_trained(node) for node in nested):
        return module
    return jax.tree.map(
        lambda node: plain_module(node) if _made_by_trained(node) else node,
        module,
        is_leaf=_made_by_trained,
    )


def _made_by_trained(node: Any) -> bool:
    return getattr(type(node), "_fuseloop_base", None) is not None


class from_equinox:  # noqa: N801
    """Adapts an equinox module applied per example (vmapped over the batch axis).

    Variables are `{"params": the module's inexact arrays}`. Training runs the module with
    `eqx.nn.inference_mode(module, False)` and evaluation with `True`, and a `__call__`
    taking `inference` (or another recognised flag: `fl.models.TRAIN_FLAGS`) is passed its
    value, so Dropout is on only while training. Layers with `eqx.nn.State` (BatchNorm) are
    refused with an error that names them.

    Keys, for a module whose `__call__` takes `key`:

    - Training: the step's key (`rng`, drawn from the trainer's seed and the global step, so
      fused and unfused runs agree) is split into one key per example; a `batched=True`
      module gets the step's key itself, one for the batch.
    - Evaluation (`apply`, `fl.predict`, evaluators, validation): a `__call__` with a default
      for `key` (`key=None`) is called without it. One that requires `key` (`*, key`) gets
      `jax.random.PRNGKey(0)`, the same key for every example and batch. In inference mode
      equinox's Dropout ignores its key, so this key cannot change those layers' outputs; a
      module that draws from `key` by itself sees this fixed key, so its evaluation is
      deterministic and an example's output does not depend on its batch.

    Args:
        module: The equinox module, applied to one example (or, `batched=True`, to a batch).
        batched: Whether `module` takes the whole batch at once instead of one example.

    Example:
        >>> import equinox as eqx, jax
        >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
        >>> model.apply(model.init(None, None), jax.numpy.ones((3, 4))).shape
        (3, 2)

        A `__call__` that requires `key` (common equinox style) evaluates too:

        >>> class Net(eqx.Module):
        ...     linear: eqx.nn.Linear
        ...     dropout: eqx.nn.Dropout
        ...     def __call__(self, x, *, key):
        ...         return self.dropout(self.linear(x), key=key)
        >>> model = from_equinox(Net(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)),
        ...                          eqx.nn.Dropout(0.5)))
        >>> model.apply(model.init(None, None), jax.numpy.ones((3, 4))).shape
        (3, 2)
    """

    # Initialised when built: its seed cannot reach the weights (engine/population.py).
    initialised_when_built = "an equinox"

    def __init__(self, module: Any, batched: bool = False):
        import equinox as eqx

        self._eqx = eqx
        module = plain_module(module)  # (`fl.models.trained`'s evaluating subclass)
        stateful = _equinox_stateful_layers(module)
        if stateful:
            raise ValueError(
                f"model: equinox layers that keep state in an eqx.nn.State are not supported "
                f"({'; '.join(stateful)}): their state would have to be threaded through "
                f"every call. Use a stateless normalization (eqx.nn.LayerNorm, "
                f"eqx.nn.GroupNorm), or write the step yourself with fl.loop(step_fn)"
            )
        self.module = module
        self.params, self.static = eqx.partition(module, eqx.is_inexact_array)
        self.batched = batched
        self.flags = call_flags(module)  # `__call__`'s own train/eval flags (`inference`)
        self.takes_key = takes_keyword(type(module).__call__, "key")
        self.requires_key = self.takes_key and _requires_keyword(type(module).__call__, "key")
        if not self.takes_key:  # equinox's convention: the key is `key`, and only that
            _refuse_other_key_names(type(module))
        dropouts = [
            path
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                module, is_leaf=lambda node: isinstance(node, eqx.nn.Dropout)
            )[0]
            if isinstance(leaf, eqx.nn.Dropout)
        ]
        self.unknown_flags = unrecognised_flags(module)  # flags of other names (_mode_follow)
        if dropouts and not self.takes_key:
            raise ValueError(
                f"model: {type(module).__name__} has eqx.nn.Dropout (at model"
                f"{jax.tree_util.keystr(dropouts[0])}) but its __call__ takes no `key`, so "
                f"Dropout cannot draw a mask while training. Add `key=None` to __call__ and "
                f"pass it on to the Dropout layers"
            )

    def warn_for_training(self, tx: Any) -> None:
        """Warns where some layers are set to inference by hand while others train (an
        eqx.nn.Dropout(p, inference=True)): a trainer runs its steps under
        `eqx.nn.inference_mode(module, False)`, which switches every layer on, where a
        hand-written loop would keep that one off. A module wholly in inference mode is
        expected to be switched. (An equinox module cannot change after the trainer took
        it, so its runs need not look again, as an nnx one's do.)"""
        held, training = [], False
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.static)[0]:
            if isinstance(leaf, bool) and getattr(path[-1], "name", None) == "inference":
                held += [f"model{jax.tree_util.keystr(path[:-1])}"] if leaf else []
                training = training or not leaf
        if held and training:
            warn(
                f"the equinox module holds layers in inference mode ({', '.join(held[:4])}"
                f"{', ...' if len(held) > 4 else ''}) while others train: a trainer runs its "
                f"steps under eqx.nn.inference_mode(module, False), so such a layer trains "
                f"too (dropout drops). To keep one off, pass inference=True in its call "
                f"(self.dropout(x, inference=True))",
                UserWarning,
            )

    def refuse_other_fields(self, module: Any, argument: str) -> None:
        """A ValueError where `module`, given to a run or to `fl.predict` in place of this
        adapter's, holds other values in its fields that are not trained (an int or bool
        array, a Python number): those are baked into this adapter's programs, so the
        given module's would be replaced by this one's with no word. Only fields of one
        layout are compared, and not flags (`inference`, which each call sets), functions
        or keys."""
        if module is self.module:
            return
        _, static = self._eqx.partition(plain_module(module), self._eqx.is_inexact_array)
        mine, theirs = (jax.tree_util.tree_flatten_with_path(t) for t in (self.static, static))
        built_on: Any = mine[1]  # a PyTreeDef, compared with == (jax's stubs leave it open)
        if built_on != theirs[1]:  # another layout: not judged here
            return
        pairs = zip(mine[0], theirs[0], strict=True)
        differ = [f"model{jax.tree_util.keystr(p)}" for (p, a), (_, b) in pairs if _differ(a, b)]
        if differ:
            raise ValueError(
                f"{argument}: the equinox module holds other values than the one the loop "
                f"(or fl.predict's model) was built on in fields that are not trained "
                f"({', '.join(differ[:3])}: int or bool arrays, numbers). Those are "
                f"compiled into the programs, so they would be replaced by the built-on "
                f"module's. Build the loop on this module (fl.trainer(module, ...)), or "
                f"give both modules the same fields"
            )

    def init(self, rng: Any, x: Any) -> Any:
        """`{"params": a copy of the module's inexact arrays}`.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> model.init(None, None)["params"].weight.shape
            (2, 4)
        """
        return {"params": jax.tree.map(lambda a: a, self.params)}

    def apply(self, variables: Any, x: Any) -> Any:
        """The module's output on the batch `x`, in inference mode.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> model.apply(model.init(None, None), jax.numpy.ones((5, 4))).shape
            (5, 2)
        """
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """`(output, None)`; a module taking `key` gets keys as the class describes.

        In training a module taking `key` gets one key per example split from `rng` (a
        `batched` module gets `rng` itself); in evaluation (`train=False`) a module that
        requires `key` gets the fixed `jax.random.PRNGKey(0)`, and one with a default for it
        none.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> x = jax.numpy.ones((5, 4))
            >>> y, state = model.forward(model.init(None, None), x, train=True, rng=None)
            >>> y.shape, state
            ((5, 2), None)
        """
        module = self._eqx.nn.inference_mode(
            self._eqx.combine(variables["params"], self.static), value=not train
        )
        key, flags = self._key(train, rng), flag_values(self.flags, train)

        def fresh() -> tuple[Any, Any]:  # for a call with a flag flipped (_mode_follow)
            return module, lambda extra: self._call(module, x, key, {**flags, **extra}, train)

        call = lambda: self._call(module, x, key, flags, train)  # noqa: E731
        return run_following_modes(module, call, fresh, self.unknown_flags, train), None

    def _call(self, module: Any, x: Any, key: Any, flags: dict[str, bool], train: bool) -> Any:
        """The module's output on the batch `x`, with `key` (None: none) as `forward` says."""
        if self.batched:
            return module(x, **flags) if key is None else module(x, key=key, **flags)
        if key is None:
            return jax.vmap(lambda xi: module(xi, **flags))(x)
        if train:
            keys = jax.random.split(key, batch_size(x))  # x may be a dict or tuple
            return jax.vmap(lambda xi, k: module(xi, key=k, **flags))(x, keys)
        return jax.vmap(lambda xi: module(xi, key=key, **flags))(x)

    def _key(self, train: bool, rng: Any) -> Any:
        """The key for this call (None: call the module without `key`)."""
        if not self.takes_key:
            return None
        if train:
            if rng is None and self.requires_key:
                raise ValueError(
                    "rng: the module's __call__ requires `key`, so training needs a key "
                    "(forward(..., train=True, rng=key))"
                )
            return rng
        if self.requires_key:
            return jax.random.PRNGKey(_INFERENCE_KEY_SEED)
        return None


def _differ(a: Any, b: Any) -> bool:
    """Whether two fields that are not trained hold other numbers: int or bool arrays by
    shape and value (whatever their width or library), Python numbers by value (NaN the
    same as NaN). Flags, functions, keys and anything else are not judged."""
    if _whole_array(a) and _whole_array(b):
        x, y = np.asarray(a), np.asarray(b)
        return x.shape != y.shape or not np.array_equal(x, y)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return numbers and a != b and not (a != a and b != b)


def _whole_array(value: Any) -> bool:
    """An array of ints or bools (numpy's or jax's; a PRNG key's dtype is neither)."""
    dtype = getattr(value, "dtype", None)
    try:
        return hasattr(value, "shape") and np.dtype(dtype).kind in "biu"
    except TypeError:  # a PRNG key's dtype, which numpy does not know
        return False
