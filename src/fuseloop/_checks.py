"""Input checks: bad batches fail early, with an error that says what, where and how to fix.

The first batch of a run is checked thoroughly, before anything compiles: its structure,
and - for a trainer or an evaluator - whether x fits the model and y its output and the
loss (`jax.eval_shape`, abstract: nothing runs; see `_model_fit.py`). Every later batch
is compared with the first by a `(shape, dtype)` per leaf; only a new one is diagnosed.

    unfused: a batch whose leaves differ from the first batch's only along the batch axis
             (a ragged last batch) is allowed once - jit compiles for it once - with a warning
             (none for an evaluator, whose data keeps its short batch so every example counts);
             any other difference raises a ValueError naming the leaf, expected and actual.
    fused:   every batch must match the first batch (the chunk program compiles once),
             otherwise `FusionError`.

Sparse labels and binary targets are range-checked on the host in every mode
(`_label_rule.LabelRule`, `_label_checks`). What JAX narrows while 64-bit mode is off is
checked in `_narrowing.py`: float64 warns once per run, an int64 beyond 32 bits is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._batch_checks import (
    MixedRows,
    check_pair_sizes,
    check_python_lists,
    leaf_signature,
    refuse_no_device_dtype,
    require_pair,
    shape_and_dtype,
)
from ._fusion import FusionError
from ._label_checks import LabelChecks
from ._mismatch_advice import mismatch_fix
from ._model_fit import ModelFit, abstract
from ._narrowing import Narrowing
from ._short_batch import ShortBatch
from ._step_state_check import check_optimizer_fits, check_step_keeps_state, explain_step_change

__all__ = ["Checker"]


class Checker:
    """Checks batches as they arrive; cheap enough to run on every batch. `program`: the
    loop's `Program` (its kind, model and loss decide what is checked)."""

    def __init__(self, program: Any, cache: dict[Any, Any] | None = None, jit: bool = True):
        self.program, self.jit = program, jit
        # The abstract model checks trace the model; their verdicts are kept per Loop, keyed
        # by the shapes checked, so a second run of the same loop pays nothing for them.
        self.cache = cache if cache is not None else {}
        self.pairs = program.kind in ("trainer", "evaluator")
        self.named_loss = isinstance(program.loss, str)  # per example: y has an example axis
        self.treedef: Any = None
        self.names: tuple[str, ...] = ()
        self.expected: tuple[tuple[Any, Any], ...] = ()
        self.accepted: set[tuple[Any, ...]] = set()
        self.short = ShortBatch(program.kind)  # an unfused run's one ragged batch
        # x's leaves hold nodes and edges: y's rows are the examples (or MixedRows)
        self.graph: bool | MixedRows = False
        self.fit = ModelFit(program)  # x and y against the model and loss, abstractly
        self.first_batch: Any = None
        self.short_checked: Any = None  # a list's last batch, checked once (`refuse_short`)
        self.step_signature: Any = None  # a deferred step check's state signature
        self.labels = LabelChecks()
        self.narrowing = Narrowing(program.data_name)

    # ----------------------------------------------------------------- entry points
    def first(self, batch: Any, source: Any = None) -> None:
        """Called once with the run's first batch, before anything compiles.

        `source`: the run's data source. Where it is an in-memory dataset whose labels an
        earlier run found in range for this loss (`dataset`), the labels are not read again:
        the source holds private copies, so they cannot have changed.
        """
        self.labels.use(source)
        leaves, treedef = jax.tree.flatten(batch)
        expected = tuple(leaf_signature(leaf) for leaf in leaves)
        # What depends on the batch's structure, shapes and types alone is checked once per
        # signature (a later run of the same data pays one lookup); labels are values, and
        # so are a one-budget graph batch's ids, read with the first run's batch only. Only
        # a custom loop's verdict depends on jit (`_first_of_its_kind`).
        key = ("first_batch", treedef, expected, None if self.pairs else self.jit)
        known = self.cache.get(key)
        self.first_batch, self.treedef, self.expected = batch, treedef, expected
        self.accepted = {expected}
        if known is None:
            known = self._first_of_its_kind(batch, leaves, source)
            self.cache[key] = known
        else:
            self.names, any_float64, fit, self.graph = known
            self.fit.restore(fit)
            if any_float64:  # only then are the leaves looked at
                self.narrowing.warn_float64(self.names, leaves)
        self.narrowing.note(expected)
        self.narrowing.batch(self.names, leaves, "the run's first batch")
        if self.pairs and not self.labels.settle(self.fit.labels):
            self.labels.batch(self.fit.labels, batch, "the run's first batch")

    def _first_of_its_kind(self, batch: Any, leaves: list[Any], data: Any) -> tuple[Any, ...]:
        """The checks of a first batch whose signature no run of this loop has seen (the
        model checks trace the model); what a later run needs of them, to keep."""
        if self.pairs:
            require_pair(batch, "the run's first batch", data)
            check_python_lists(batch, "the run's first batch")
            self.graph = check_pair_sizes(batch, "the run's first batch", self.named_loss)
        elif self.jit:  # jit reads every leaf as an array (a trainer's checks name them)
            refuse_no_device_dtype(batch)
        paths = jax.tree_util.tree_flatten_with_path(batch)[0]
        self.names = tuple(self._leaf_name(path) for path, _ in paths)
        self.narrowing.refuse_byte_order(self.names, self.expected)
        any_float64 = any(dtype == np.float64 for _, dtype in self.expected)
        if any_float64:
            self.narrowing.warn_float64(self.names, leaves)
        if self.pairs:
            self.fit.check_first(batch)
        return self.names, any_float64, self.fit.verdict(), self.graph

    def batch(self, batch: Any, epoch: int, iteration: int) -> None:
        """Called for each unfused batch before it is moved to the device."""
        self._check(batch, epoch, iteration, fused=False)

    def chunk(self, batches: list[Any], epoch: int, first_iteration: int) -> None:
        """Called for each fused chunk's batches before they are stacked.

        Only the chunk's first batch is compared with the run's first (a mismatch there
        would compile the fused program again); stacking compares every other batch with
        it (one that is not a pair fails to stack, and `first_refused` names it), and
        `stacked` reads the values of the whole chunk at once (labels, 64-bit integers).
        """
        if batches[0] is not self.first_batch:  # the run's first batch: checked already
            self._check(batches[0], epoch, first_iteration, fused=True, values=False)

    def first_refused(
        self, batches: list[Any], epoch: int, first_iteration: int
    ) -> tuple[int, Exception | None]:
        """The offset of the first of a chunk's batches that the unfused loop would refuse,
        checked alone as it checks one, and its error (`len(batches), None`: none is)."""
        for offset, batch in enumerate(batches):
            try:
                self._check(batch, epoch, first_iteration + offset, fused=True)
            except Exception as error:  # noqa: BLE001 - the answer
                return offset, error
        return len(batches), None

    def refuse_short(self, batches: Sequence[Any], epoch: int) -> None:
        """Raises, before the epoch's first step, the `FusionError` a fused chunk would
        raise at the last of a list's `batches` where only a shorter batch axis sets it
        apart and every batch before it is like the first (any other is refused where it
        comes, as the unfused loop meets it). Once per run."""
        last, seen = batches[-1], self.short_checked
        self.short_checked = last
        if last is seen or not self._short_batch(last):
            return
        if all(self._signature(batch) in self.accepted for batch in batches[1:-1]):
            leaves, treedef = jax.tree.flatten(last)
            where = (epoch, len(batches) - 1)
            self._diagnose(last, leaves, treedef, self._signature(last), *where, fused=True)

    def _short_batch(self, batch: Any) -> bool:
        """Whether only a shorter batch axis sets `batch`, of arrays, apart from the first."""
        leaves, treedef = jax.tree.flatten(batch)
        arrays = all(isinstance(leaf, (np.ndarray, jax.Array)) for leaf in leaves)
        if treedef != self.treedef or not arrays:
            return False
        pairs = tuple(zip(self.expected, self._signature(batch), strict=True))
        if not all(e == a or self._differs_on_batch_axis(e, a) for e, a in pairs):
            return False
        fewer_rows = [a[0][0] < e[0][0] for e, a in pairs if e[0] != a[0]]
        return bool(fewer_rows) and all(fewer_rows)

    @staticmethod
    def _signature(batch: Any) -> tuple[Any, ...]:
        return tuple(leaf_signature(leaf) for leaf in jax.tree.leaves(batch))

    def stacked(self, chunk: Any, n: int, epoch: int, first_iteration: int) -> None:
        """Called with a stacked chunk of `n` live batches: its labels and 64-bit integers,
        in one pass."""
        self.labels.chunk(self.fit.labels, chunk, n, epoch, first_iteration)
        if self.narrowing.reads:  # only then: this runs for every chunk
            where = f"epoch {epoch}, iterations {first_iteration}-{first_iteration + n - 1}"
            self.narrowing.batch(self.names, jax.tree.leaves(chunk), where)

    # ----------------------------------------------------------------- per batch
    def _check(
        self, batch: Any, epoch: int, iteration: int, fused: bool, values: bool = True
    ) -> None:
        """`values`: read the batch's values here (labels, 64-bit integers); a fused
        chunk's are read once, stacked (`stacked`)."""
        if self.treedef is None:  # no first batch was seen: this one sets the reference
            self.first(batch, self.labels.source)
        leaves, treedef = jax.tree.flatten(batch)
        signature = tuple(leaf_signature(leaf) for leaf in leaves)
        if signature not in self.accepted or treedef != self.treedef:
            self._diagnose(batch, leaves, treedef, signature, epoch, iteration, fused)
        if values:
            where = f"epoch {epoch}, iteration {iteration}"
            self.narrowing.batch(self.names, leaves, where)
            self.labels.batch(self.fit.labels, batch, where)

    def _diagnose(
        self,
        batch: Any,
        leaves: list[Any],
        treedef: Any,
        signature: tuple[Any, ...],
        epoch: int,
        iteration: int,
        fused: bool,
    ) -> None:
        """A batch whose signature was not seen before: accept it, warn, or raise."""
        step = f"epoch {epoch}, iteration {iteration}"
        at, where = f"the batch at {step}", f"data: the batch at {step}"
        error = FusionError if fused else ValueError
        if self.pairs:  # the same errors fused and unfused: checked before any fusion error
            require_pair(batch, at)
            check_python_lists(batch, at)
            check_pair_sizes(batch, at, self.named_loss, self.graph)
        if treedef != self.treedef:
            raise error(
                f"{where} has structure {treedef}, but the run's first batch has "
                f"{self.treedef}; every batch must have the same structure (the same "
                f"containers, keys and number of arrays)"
            )
        # values a cast would wrap are refused before a mismatch, whose fix is a cast
        self.narrowing.note_later(signature, self.names, leaves, step)
        short = False
        for name, expected, actual in zip(self.names, self.expected, signature, strict=True):
            if self._same(expected, actual, fused):
                continue
            if fused or not self._differs_on_batch_axis(expected, actual):
                raise error(self._mismatch(where, name, expected, actual, fused))
            short = True
        if short:
            self.short.allow(self.names, self.expected, signature, where, self.graph)
        self.narrowing.warn_float64(self.names, leaves)
        self.accepted.add(signature)

    @staticmethod
    def _same(expected: tuple[Any, Any], actual: tuple[Any, Any], fused: bool) -> bool:
        """Equal as the step sees them: unfused, JAX casts float64 to float32 (x64 off), so
        those match; a fused chunk is stacked on the host, so its dtypes must match exactly."""
        if expected == actual:
            return True
        if fused or expected[0] != actual[0]:
            return False
        if isinstance(expected[1], str) or isinstance(actual[1], str):
            return False
        canonical = jax.dtypes.canonicalize_dtype
        return canonical(expected[1]) == canonical(actual[1])

    def _differs_on_batch_axis(self, expected: tuple[Any, Any], actual: tuple[Any, Any]) -> bool:
        shape, other = expected[0], actual[0]
        return (
            len(shape) >= 1
            and len(shape) == len(other)
            and shape[1:] == other[1:]
            and self._same(((), expected[1]), ((), actual[1]), fused=False)
        )

    def _mismatch(
        self, where: str, name: str, expected: tuple[Any, Any], actual: tuple[Any, Any], fused: bool
    ) -> str:
        """The message for a leaf unlike the first batch's; it suggests fuse=False only
        where the unfused loop takes the leaf (float64 for float32, a short batch axis)."""
        unfused_takes_it = fused and (
            self._same(expected, actual, fused=False)
            or self._differs_on_batch_axis(expected, actual)
        )
        fix = mismatch_fix(expected, actual, unfused_takes_it, self.program.kind, self.graph)
        return (
            f"{where}: leaf {name} has shape {actual[0]} dtype {actual[1]}, expected "
            f"shape {expected[0]} dtype {expected[1]} like the run's first batch; {fix}"
        )

    def _leaf_name(self, path: tuple[Any, ...]) -> str:
        head = path[0] if path else None
        if self.pairs and isinstance(head, jax.tree_util.SequenceKey) and head.idx in (0, 1):
            return ("x", "y")[head.idx] + jax.tree_util.keystr(path[1:])
        return "batch" + jax.tree_util.keystr(path)

    def dataset(self, data: Any, iterations: int | None = None) -> None:
        """Called once per run with the data source: the labels of a whole in-memory
        dataset (`fl.data.arrays`, device-resident or not) are range-checked here on the
        host, so a fused and an unfused run over device-resident data (whose batches the
        host never sees) reject a bad label alike; found in range, they vouch for every
        batch drawn from them (`LabelChecks`). Where the rule is known only with the run's
        variables, `variables` checks them. A resident dataset's short last batch, which
        the run reaches (`iterations` per epoch, None: all), is warned about here."""
        if getattr(data, "resident", False):  # the host never sees its batches
            self.narrowing.warn_float64(self.names, jax.tree.leaves((data.x, data.y)))
            if data.short_batch and (iterations is None or iterations >= len(data)):
                self.short.warn_resident(data.batch_size, data.short_batch)
        self.narrowing.dataset(self.names, data)
        self.labels.use(data)
        self.labels.dataset(self.fit.labels)

    # ----------------------------------------------------------------- model fit
    def variables(self, step_state: Any, signature: Any = None, defer: bool = False) -> None:
        """Called once with the initial step state, before anything compiles.

        `first` checks x against a freshly initialized model; an evaluator, or a trainer
        given trained variables, runs with the caller's variables instead, so x is checked
        against those here (and y and the loss too where the fresh variables did not fit:
        the variables the run starts from decide). Then one step, evaluated abstractly, must
        keep the step state's structure, dtypes and shapes; `defer` (a jitted run, whose
        device loop fails to trace such a step) leaves that to `explain`.
        `signature`: the step state's `(treedef, ((shape, dtype), ...))` where the program
        that made it knows it (the trainer's init), so the state is not walked again.
        """
        if signature is None:
            leaves, treedef = jax.tree.flatten(step_state)
            try:
                signature = treedef, tuple(shape_and_dtype(leaf) for leaf in leaves)
            except TypeError:  # a non-array leaf: the run itself reports what is wrong
                signature = None
        key = (
            None if signature is None else ("checked_step", self.treedef, self.expected, *signature)
        )
        if key is None or key not in self.cache:
            self._check_variables(step_state)
            if key is None or self.first_batch is None or self.program.kind == "evaluator":
                return
            if self.program.kind == "trainer":
                check_optimizer_fits(self.program.optimizer, step_state)
            self.cache[key] = (self.fit.labels, False)  # the step: not checked yet
        labels, step_checked = self.cache[key]
        self._found_labels((labels,))
        if step_checked:
            return
        if defer:  # the device loop's trace will find it (`explain`)
            self.step_signature = signature
            return
        check_step_keeps_state(self.program.step, step_state, self.first_batch)
        self.cache[key] = (labels, True)

    def explain(self, error: BaseException) -> BaseException:
        """The error a run that failed before its first dispatch raises: where the step
        check was deferred (`variables`) and the step changes the step state, the check's
        ValueError (naming the leaf and the fix; the run raises it from `error`); else
        `error` itself.
        """
        signature, self.step_signature = self.step_signature, None
        if signature is None or not isinstance(error, (TypeError, ValueError)):
            return error
        return explain_step_change(self.program.step, signature, self.first_batch) or error

    def _check_variables(self, step_state: Any) -> None:
        if (
            self.fit.first_x is None
            or not isinstance(step_state, dict)
            or ("params" not in step_state)
        ):
            return
        # Keyed by the raw leaves (cheap); the abstract tree is built only when checking.
        leaves, treedef = jax.tree.flatten(step_state["params"])
        signature = tuple(shape_and_dtype(leaf) for leaf in leaves)
        key = ("checked_variables", self.treedef, self.expected, treedef, signature)
        if key not in self.cache:
            rule = self.fit.labels
            self.fit.check_run_variables(jax.tree.map(abstract, step_state["params"]))
            self.cache[key] = (self.fit.labels,)
            self.fit.labels = rule
        self._found_labels(self.cache[key])

    def _found_labels(self, verdict: tuple[Any]) -> None:
        """Where the labels' rule was found only with the run's variables (their fresh ones
        did not fit, or an evaluator's init could not be evaluated), the labels `first` and
        `dataset` could not check yet are checked now."""
        if self.fit.labels is not None or verdict[0] is None:
            return
        rule = self.fit.labels = verdict[0]
        if self.labels.settle(rule):
            return
        if self.first_batch is not None:
            self.labels.batch(rule, self.first_batch, "the run's first batch")
        self.labels.dataset(rule)
