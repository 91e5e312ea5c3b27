"""The one batch of other rows an unfused run takes: a ragged last batch, for which jit
compiles the step once more (`_checks.Checker` finds it; docs/design.md, input checks).

A batch whose leaves all hold one number of rows has one batch size, and its short batch
holds fewer rows in every leaf. A padded graph batch (nodes, edges, a graph index per
node) holds different numbers of rows in different leaves; its short batch (fewer graphs,
padded to a smaller budget) changes several of them, and y's rows count its examples.
"""

from __future__ import annotations

from typing import Any

from ._warn import warn

__all__ = ["ShortBatch"]

Signature = tuple[tuple[Any, Any], ...]  # (shape, dtype) per leaf


class ShortBatch:
    """The rows of the run's one short batch, once one came; `kind`: the program's kind
    (an evaluator's short batch is expected: no warning)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.rows: tuple[int | None, ...] | None = None  # per leaf; None: no example axis

    def allow(self, names: tuple[str, ...], first: Signature, batch: Signature, where: str) -> None:
        """Takes `batch`, whose leaves differ from the run's `first` batch's along axis 0
        only, as the run's short batch, or raises where it cannot be one."""
        first_rows, rows = _rows(first), _rows(batch)
        mixed = len({size for size in first_rows if size is not None}) > 1
        changed = {new for old, new in zip(first_rows, rows, strict=True) if new not in (old, None)}
        if not mixed and len(changed) > 1:
            raise ValueError(
                f"{where} has leaves with different batch sizes {sorted(changed)}; every leaf "
                f"of x and y must hold the same number of examples"
            )
        full, size = _examples(names, first_rows), _examples(names, rows)
        if self.rows is None:
            self.rows = rows
            if self.kind != "evaluator":  # every example counts in evaluation
                self._warn(where, full, size)
            return
        if rows != self.rows:
            fix = (
                "pad every batch to the same numbers of rows (one padding budget for nodes "
                "and edges, as jraph.pad_with_graphs takes)"
                if mixed
                else "Use batches of equal size"
            )
            raise ValueError(
                f"{where} has batch size {size}, after batches of {full} and "
                f"{_examples(names, self.rows)}; only one short batch size (a ragged last "
                f"batch) is allowed, because each new batch size recompiles the step. {fix}"
            )

    def _warn(self, where: str, full: int | None, size: int | None) -> None:
        weighing = (
            "A metric of a step state's scalar is a mean over steps (the short batch "
            "counts as one), built-in metrics of (y_true, y_pred) weigh it by its size"
            if self.kind == "custom"
            else "The loss and per-example metrics weigh the short batch by its size (a "
            "metric returning one scalar per batch counts it as one batch)"
        )
        guess = "a ragged last batch?"
        if full is not None and size is not None and size > full:
            guess = "the run's first batch sets the batch size: was it a short one?"
        warn(
            f"{where} has batch size {size} instead of {full} ({guess}); the step "
            f"compiles once more for it. {weighing}. In training data, "
            f"drop_remainder=True avoids the extra compile"
        )


def _rows(signature: Signature) -> tuple[int | None, ...]:
    return tuple(shape[0] if len(shape) >= 1 else None for shape, _ in signature)


def _examples(names: tuple[str, ...], rows: tuple[int | None, ...]) -> int | None:
    """The batch's example count: y's rows where it has them (a graph batch's x has no
    one count), else the first leaf's with an example axis."""
    with_rows = [(name, size) for name, size in zip(names, rows, strict=True) if size is not None]
    of_y = [size for name, size in with_rows if name.startswith("y")]
    counts = of_y or [size for _, size in with_rows]
    return counts[0] if counts else None
