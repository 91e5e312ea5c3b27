"""The one batch of other rows an unfused run takes: a ragged last batch, for which jit
compiles the step once more (`_checks.Checker` finds it; docs/data.md, batches).

A batch whose leaves all hold one number of rows has one batch size, and its short batch
holds fewer rows in every leaf. A padded graph batch (nodes, edges, a graph index per
node) holds different numbers of rows in different leaves; its short batch (fewer graphs,
padded to a smaller budget) changes several of them, and y's rows count its examples.
"""

from __future__ import annotations

from typing import Any

from ._graph_batch import ONE_BUDGET, holds_an_index
from ._warn import warn

__all__ = ["ShortBatch"]

Signature = tuple[tuple[Any, Any], ...]  # (shape, dtype) per leaf
Rows = tuple[int | None, ...]  # rows per leaf; None: no example axis


class ShortBatch:
    """The rows of the run's one short batch, once one came; `kind`: the program's kind
    (an evaluator's short batch is expected: no warning)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.rows: Any = None  # the short batch's: its size, or a graph batch's rows per leaf

    def allow(
        self,
        names: tuple[str, ...],
        first: Signature,
        batch: Signature,
        where: str,
        graph: object,
    ) -> None:
        """Takes `batch`, whose leaves differ from the run's `first` batch's along axis 0
        only, as the run's short batch, or raises where it cannot be one (`graph`: the
        batches are graph batches, whose y's rows are their examples)."""
        first_rows, rows = _rows(first), _rows(batch)
        key: Any
        if graph is True:
            full, size, key = _rows_of_y(names, first_rows), _rows_of_y(names, rows), rows
        else:
            changed = {n for old, n in zip(first_rows, rows, strict=True) if n not in (old, None)}
            if len(changed) > 1:
                raise ValueError(
                    f"{where} has leaves with different batch sizes {sorted(changed)}; every "
                    f"leaf of x and y must hold the same number of examples"
                    f"{ONE_BUDGET if _indexed(names, first) else ''}"
                )
            full = next((size for size in first_rows if size is not None), None)
            size = key = changed.pop()
        if self.rows is None:
            self.rows = key
            if self.kind == "evaluator":  # every example counts in evaluation
                return
            if graph is True and size == full:  # as many examples, padded otherwise
                warn(
                    f"{where} is padded to other rows ({_named(names, rows)}) than the run's "
                    f"first batch ({_named(names, first_rows)}), with as many examples; the "
                    f"step compiles once more for it. Pad every batch to one budget for "
                    f"nodes and edges (as jraph.pad_with_graphs takes) to compile once"
                )
                return
            self._warn(where, full, size)
            return
        if key == self.rows:
            return
        if graph is True:
            raise ValueError(
                f"{where} is padded to other rows ({_named(names, rows)}) than the run's "
                f"batches ({_named(names, first_rows)}) and the one batch padded otherwise "
                f"({_named(names, self.rows)}); only one batch of other rows (a ragged last "
                f"batch) is allowed, because each new padding recompiles the step. Pad every "
                f"batch to the same numbers of rows (one padding budget for nodes and edges, "
                f"as jraph.pad_with_graphs takes)"
            )
        raise ValueError(
            f"{where} has batch size {size}, after batches of {full} and {self.rows}; "
            f"only one short batch size (a ragged last batch) is allowed, because each new "
            f"batch size recompiles the step. Use batches of equal size"
        )

    def warn_resident(self, full: int, size: int) -> None:
        """A device-resident dataset's short last batch (`drop_remainder=False`): the host
        never sees it, so the run warns at its start, as an unfused run does on meeting one
        (an evaluator's is expected)."""
        if self.kind != "evaluator":
            where = "data: the dataset's last batch of each epoch"
            self._warn(where, full, size, "drop_remainder=False")

    def _warn(self, where: str, full: int | None, size: int | None, guess: str = "") -> None:
        weighing = (
            "A metric of a step state's scalar is a mean over steps (the short batch "
            "counts as one), built-in metrics of (y_true, y_pred) weigh it by its size"
            if self.kind == "custom"
            else "The loss and per-example metrics weigh the short batch by its size (a "
            "metric returning one scalar per batch counts it as one batch)"
        )
        guess = guess or "a ragged last batch?"
        if full is not None and size is not None and size > full:
            guess = "the run's first batch sets the batch size: was it a short one?"
        warn(
            f"{where} has batch size {size} instead of {full} ({guess}); the step "
            f"compiles once more for it. {weighing}. In training data, "
            f"drop_remainder=True avoids the extra compile"
        )


def _indexed(names: tuple[str, ...], signature: Signature) -> bool:
    """Whether x held a vector of integers beside other leaves: a graph batch, perhaps."""
    x = [leaf for name, leaf in zip(names, signature, strict=True) if name.startswith("x")]
    return holds_an_index(x)


def _rows(signature: Signature) -> Rows:
    return tuple(shape[0] if len(shape) >= 1 else None for shape, _ in signature)


def _rows_of_y(names: tuple[str, ...], rows: Rows) -> int | None:
    """A graph batch's example count: y's rows (its x holds nodes and edges)."""
    return next(
        (n for name, n in zip(names, rows, strict=True) if name.startswith("y") and n), None
    )


def _named(names: tuple[str, ...], rows: Rows) -> str:
    return ", ".join(f"{name}: {n}" for name, n in zip(names, rows, strict=True) if n is not None)
