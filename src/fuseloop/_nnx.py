"""The flax.nnx adapter: the module split into its params and the rest of its state.

Re-exported from `fuseloop.models` (as `fl.models.from_nnx`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import jax

from ._data_flow import output_reads_inputs
from ._linen import NNX_MODE_FLAGS, ModelConventionError, call_flags, flag_values
from ._mode_follow import run_following_modes, unrecognised_flags
from ._nnx_checks import (
    count_values,
    eval_flags,
    handed_back,
    param_values,
    raw_value,
    refuse_eval_draws,
    refuse_other_shapes,
    refuse_param_writes,
    refuse_sown_before,
    rng_counts,
)
from ._warn import warn

__all__ = ["from_nnx", "set_nnx_mode"]


class from_nnx:  # noqa: N801
    """Adapts a flax.nnx module.

    Variables are `{"params": ..., "state": ...}` pure dicts (the Param variables, and
    everything else: batch statistics, RNG streams).

    Dropout and BatchNorm switch with `module.train()`/`module.eval()`, and a `__call__`
    taking a recognised flag (`train`, `deterministic`, ...: `fl.models.TRAIN_FLAGS`) is
    passed its training or evaluation value; the module's own RNG streams are part of
    `"state"`, so they advance with each step and checkpoint.
    Variables are rebuilt from plain arrays inside each traced call, so nnx never sees a
    Variable created at another trace level (inside `grad` or the fused loop).

    Example:
        >>> from flax import nnx
        >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        >>> sorted(model.init(None, None)["params"])
        ['bias', 'kernel']
    """

    # Initialised when built: its seed cannot reach the weights (engine/population.py).
    initialised_when_built = "an nnx"
    # Why the trainer's seed reaches nothing of an nnx model (said when one is given).
    seed_unused = (
        "its weights were initialised when it was built, and its dropout draws from the "
        "nnx.Rngs it holds"
    )

    def __init__(self, module: Any):
        from flax import nnx

        self._nnx, self.module = nnx, module
        self.flags = call_flags(module)  # `__call__`'s own train/eval flags, if any
        self.unknown_flags = unrecognised_flags(module)  # flags of other names (_mode_follow)
        self._held_warned: list[str] | None = None  # the layers held in evaluation mode
        self.graphdef, params, *others = nnx.split(module, nnx.Param, ...)
        (rest,) = others  # the two filters, Param and `...`, split the module in two
        self._templates = (params, rest)
        # Intermediates the module holds as attributes of its own are state it keeps; only
        # those a call sows anew are outputs of the call (`_run`).
        self._held = {
            path for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Intermediate)
        }
        # The module's graph as traced into the programs, and its Variables: whether a
        # value changed since the last read is a cheap comparison (splitting the module
        # costs ~150 us; comparing ~10 values ~1 us).
        self._graph = _Graph(module)
        self._read: tuple[list[Any], Any] | None = None  # (the values read, their dicts)

    def current_variables(self) -> Any:
        """The module's variables as they are now, as pure dicts of its arrays (not
        copies). A run without initial variables starts from them, so weights loaded into
        the module after `fl.trainer(...)` are the ones trained.

        Example:
            >>> from flax import nnx
            >>> layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
            >>> model = from_nnx(layer)
            >>> layer.bias[...] = layer.bias[...] + 1.0
            >>> model.current_variables()["params"]["bias"].tolist()
            [1.0, 1.0]
        """
        self.check_structure()
        values = [raw_value(v) for v in self._graph.variables]
        if self._read is not None and all(map(operator.is_, values, self._read[0])):
            return self._read[1]
        _, params, *others = self._nnx.split(self.module, self._nnx.Param, ...)
        (rest,) = others  # as in __init__: Param, and the rest
        pure = {"params": self._nnx.to_pure_dict(params), "state": self._nnx.to_pure_dict(rest)}
        self._read = (values, pure)
        return pure

    def warn_for_training(self, tx: Any) -> None:
        """The warnings a trainer gives about the module: `warn_param_kinds`, and layers
        set to evaluation mode, which its steps run in training mode."""
        self.warn_param_kinds(tx)
        self.warn_held_modes()

    def warn_held_modes(self) -> None:
        """Warns where the module holds layers set to evaluation mode by hand: when a
        trainer is built, and at a run's start where they changed since (a BatchNorm
        frozen after the trainer was built)."""
        held, warned = eval_flags(self.module), self._held_warned
        self._held_warned = held  # (none held in between: the next hold is new)
        if held and held != warned:
            more = f", and {len(held) - 4} more" if len(held) > 4 else ""
            warn(
                f"the nnx module holds layers in evaluation mode ({', '.join(held[:4])}"
                f"{more}): a trainer runs its steps in training mode, as module.train() "
                f"sets it, so such a layer trains (BatchNorm statistics update, dropout "
                f"drops). To keep a layer in evaluation mode while the rest trains, pass the "
                f"flag in its call, e.g. self.bn(x, use_running_average=True) or "
                f"self.dropout(x, deterministic=True); validation and fl.predict run every "
                f"layer in evaluation mode",
                UserWarning,
            )

    def warn_param_kinds(self, tx: Any) -> None:
        """Warns where the module holds variables of a kind of `nnx.Param` (`nnx.LoRAParam`,
        a user's own) and the optimizer `tx` freezes none of its params: a trainer trains
        every Param, as `nnx.Optimizer(wrt=nnx.Param)` does, so the weights a LoRA adapts
        would train too."""
        nnx = self._nnx
        found = (type(v) for _, v in nnx.iter_graph(self.module) if isinstance(v, nnx.Param))
        kinds = sorted({kind.__name__ for kind in found if kind is not nnx.Param})
        if kinds and not _freezes_some(tx, self.current_variables()["params"]):
            warn(
                f"the nnx module holds {', '.join(kinds)} variables: fuseloop trains every "
                f"nnx.Param, these and plain Params alike (nnx.Optimizer's wrt= has no "
                f"counterpart). To train only some, freeze the others in the optimizer: "
                f"optax.multi_transform({{'train': tx, 'frozen': optax.set_to_zero()}}, "
                f"labels) with labels shaped like variables['params']",
                UserWarning,
            )

    def check_structure(self) -> None:
        """Raises a ValueError if the module's structure changed since this adapter took it
        (a layer of another shape or kind, a changed static attribute): its programs were
        compiled for the old one. Every run of a loop built on it checks, and `fl.predict`
        builds a new adapter instead. A Variable replaced by one of the same shape is
        taken (its value is read like any other).

        Example:
            >>> from flax import nnx
            >>> layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
            >>> model = from_nnx(layer)
            >>> layer.kernel = nnx.Param(jnp.zeros((4, 3)))
            >>> model.check_structure()
            Traceback (most recent call last):
            ...
            fuseloop._linen.ModelConventionError: the nnx module changed structure ... kernel ...
        """
        if not self._graph.unchanged():
            self._graph = self._graph.rebuilt()  # a Variable or submodule was replaced

    def init(self, rng: Any, x: Any) -> Any:
        """A copy of the module's own variables as they are now (nnx initialises at
        construction, so `rng` is not used).

        Example:
            >>> from flax import nnx
            >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
            >>> model.init(None, None)["params"]["kernel"].shape
            (4, 2)
        """
        return jax.tree.map(lambda a: a, self.current_variables())

    def _rebuild(self, template: Any, pure: Any, part: str) -> Any:
        refuse_other_shapes(self._nnx.to_pure_dict(template), pure, part)
        fresh = jax.tree.map(lambda a: a, template)  # new Variables at this trace level
        self._nnx.replace_by_pure_dict(fresh, pure)
        return fresh

    def _merged(self, variables: Any, train: bool) -> Any:
        """The module holding `variables`, in the mode of `train`."""
        params = self._rebuild(self._templates[0], variables["params"], "params")
        rest = self._rebuild(self._templates[1], variables["state"], "state")
        module = self._nnx.merge(self.graphdef, params, rest)
        set_nnx_mode(module, train)
        return module

    def _run(self, variables: Any, x: Any, train: bool) -> tuple[Any, Any]:
        if train:
            refuse_sown_before(self._held, self.module)
        fresh = functools.partial(self._fresh_call, variables, x, train)
        module, call = fresh()
        # Training must not write Params; evaluation must not draw random numbers.
        before = param_values(module) if train else rng_counts(module)
        y = run_following_modes(module, lambda: call({}), fresh, self.unknown_flags, train)
        passed_on = functools.partial(self._passed_on, variables, x, train)  # asked if needed
        if train:
            refuse_param_writes(before, param_values(module), passed_on)
        else:
            reads = functools.partial(self._output_reads_draws, variables, x)
            refuse_eval_draws(before, rng_counts(module), module, reads, passed_on)
        # What the call sowed (`self.sow(nnx.Intermediate, ...)`) is an output of the call,
        # not state to carry: dropped, as linen's sow does nothing unless asked for.
        nnx = self._nnx
        nnx.pop(module, lambda path, node: _sown(node, path, self._held, nnx.Intermediate))
        _, _, rest = nnx.split(module, nnx.Param, ...)
        return y, nnx.to_pure_dict(rest)

    def _fresh_call(self, variables: Any, x: Any, train: bool) -> tuple[Any, Any]:
        """A module holding `variables`, and its call given extra keywords."""
        module = self._merged(variables, train)
        return module, lambda extra: module(x, **flag_values(self.flags, train), **extra)

    def _output_reads_draws(self, variables: Any, x: Any) -> bool:
        """Whether an evaluation call's output reads the numbers it draws: nnx.RNN draws a
        key for an initial carry it makes of zeros, which nothing reads (traced again, with
        the rng streams as inputs; asked only of a module that drew)."""
        nnx = self._nnx
        graphdef, draws, rest = nnx.split(self._merged(variables, False), nnx.RngState, ...)

        def call(draws: Any, rest: Any) -> Any:
            return nnx.merge(graphdef, draws, rest)(x, **flag_values(self.flags, False))

        return output_reads_inputs(jax.make_jaxpr(call)(draws, rest), len(jax.tree.leaves(draws)))

    def _passed_on(self, variables: Any, x: Any, train: bool) -> set[Any]:
        """The Params (`train`) or rng counts a call hands back unchanged (`handed_back`)."""
        merged = functools.partial(self._merged, train=train)
        call = lambda module: module(x, **flag_values(self.flags, train))  # noqa: E731
        return handed_back(variables, merged, call, param_values if train else count_values)

    def apply(self, variables: Any, x: Any) -> Any:
        """The module's output on `x` in `.eval()` mode.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
            >>> model.apply(model.init(None, None), jnp.ones((3, 4))).shape
            (3, 2)
        """
        return self._run(variables, x, train=False)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """The output and, in training, the module's updated non-Param state.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> model = from_nnx(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
            >>> variables = model.init(None, None)
            >>> y, new = model.forward(variables, jnp.ones((3, 2)), train=True, rng=None)
            >>> new["state"]["mean"].shape
            (2,)
        """
        y, rest = self._run(variables, x, train)
        return y, ({"state": rest} if train else None)


class _Graph:
    """The module's graph as the adapter traced it: every attribute edge (parent, key,
    child), so that a Variable or submodule assigned anew after the trainer took the
    module (`model.head = nnx.Linear(...)`, `layer.kernel = nnx.Param(w)`) is seen at a
    run's start, at one attribute read per edge.

    A replacement of the same structure (weights loaded by assigning Variables) is taken:
    its values are read like any other. A different structure (a new shape, another
    layer, a changed static attribute) cannot be trained by programs compiled for the old
    one, so it is an error naming what changed, never the old module trained in silence.
    """

    def __init__(self, module: Any):
        from flax import nnx

        self.module = module
        nodes = dict(nnx.iter_graph(module))
        self.edges = [(nodes[path[:-1]], path, node) for path, node in nodes.items() if path]
        self.variables = [node for node in nodes.values() if isinstance(node, nnx.Variable)]
        self.layout = _layout(nodes)

    def unchanged(self) -> bool:
        """Whether every edge still leads to the object it led to when built."""
        try:
            return all(_child(parent, path[-1]) is node for parent, path, node in self.edges)
        except (AttributeError, IndexError, KeyError, TypeError):  # a node was removed
            return False

    def rebuilt(self) -> _Graph:
        """The module's graph now; a ValueError if its structure is not the one traced."""
        fresh = _Graph(self.module)
        if fresh.layout != self.layout:
            raise ModelConventionError(_changed_structure(self.layout, fresh.layout))
        return fresh


def _child(parent: Any, key: Any) -> Any:
    """The node under `key`: an item of a dict or list (any key: a dict of layers may be
    keyed by tuples, as flax's own SpectralNorm keeps its stats), else an attribute."""
    if isinstance(parent, (Mapping, list, tuple)) or not isinstance(key, str):
        return parent[key]
    return getattr(parent, key)


# Attributes that `.train()`/`.eval()` and `set_nnx_mode` switch: the adapter sets them
# in every traced call, so a user switching the module's mode changes nothing traced.
_MODE_ATTRIBUTES = frozenset(NNX_MODE_FLAGS)


def _layout(nodes: dict[Any, Any]) -> dict[Any, Any]:
    """What the traced programs depend on, per path: a Variable's type, shape and dtype,
    a graph node's type, a static attribute's value (mode switches excepted)."""
    from flax import nnx

    layout: dict[Any, Any] = {}
    for path, node in nodes.items():
        if path and (path[-1] in _MODE_ATTRIBUTES or _internal(path)):
            continue
        if isinstance(node, nnx.Variable):
            value = raw_value(node)
            shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
            layout[path] = (type(node), shape, dtype)
        elif nnx.graph.is_graph_node(node):
            layout[path] = type(node)
        else:  # a static attribute
            layout[path] = ("static", _comparable(node))
    return layout


def _internal(path: tuple[Any, ...]) -> bool:
    """nnx's own bookkeeping inside a node (`_pytree__...`), not the user's structure."""
    return any(isinstance(key, str) and key.startswith("_pytree__") for key in path)


def _comparable(value: Any) -> Any:
    """A static attribute as compared: its value where it compares as one, else itself."""
    try:
        return value if isinstance(value == value, bool) else id(value)
    except Exception:  # noqa: BLE001 - an attribute whose == raises is compared by identity
        return id(value)


def _changed_structure(old: dict[Any, Any], new: dict[Any, Any]) -> str:
    changed = sorted(
        (path for path in old.keys() | new.keys() if old.get(path) != new.get(path)), key=str
    )
    where = ", ".join(".".join(map(str, path)) for path in changed[:3])
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    return (
        f"the nnx module changed structure after fuseloop took it: {where}{more} changed "
        f"since its loop compiled the module (a replaced layer of another shape or kind, "
        f"or a changed static attribute). Build the loop again from the changed "
        f"module (fl.trainer(model, ...), fl.evaluator(model, ...), .validate(model, ...)); "
        f"to load weights into the same structure, assign values (nnx.update(model, state) "
        f"or variable[...] = ...)"
    )


def _sown(node: Any, path: Any, held: set[Any], kind: type) -> bool:
    return isinstance(node, kind) and tuple(path) not in held


def set_nnx_mode(module: Any, train: bool) -> None:
    """Sets an nnx module to training or evaluation mode: nnx's own switch (`.train()` or
    `.eval()`), then the recognised flag attributes kept as plain bools (`self.training`).
    """
    from flax import nnx

    if hasattr(module, "train") and hasattr(module, "eval"):
        module.train() if train else module.eval()
    for _, sub in nnx.iter_graph(module):
        if not isinstance(sub, nnx.Module):
            continue
        for name, train_value in NNX_MODE_FLAGS.items():
            if isinstance(getattr(sub, name, None), bool):
                setattr(sub, name, train_value if train else not train_value)


def _freezes_some(tx: Any, params: Any) -> bool:
    """Whether `tx` leaves some param unchanged by a first update of all-ones gradients
    (`optax.multi_transform` with `optax.set_to_zero()` for a frozen part); True where the
    update cannot be made here (the run's own init then says what is wrong)."""
    from ._optim import optimizer_update

    zero = jax.numpy.zeros(())
    try:  # given what extra-args transformations read (value=...), as a step gives them
        grads = jax.tree.map(jax.numpy.ones_like, params)
        updates, _ = optimizer_update(tx, grads, tx.init(params), params, zero, lambda p: zero)
    except Exception:  # noqa: BLE001 - cannot tell: a false "freezes none" would mislead
        return True
    return any(not bool(jax.numpy.any(leaf != 0)) for leaf in jax.tree.leaves(updates))
