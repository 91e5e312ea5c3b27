"""A run's label checks: labels against their loss's rule (`_batch_checks.LabelRule`).

Batches and chunks are checked as they arrive, and an in-memory dataset's labels
(`fl.data.arrays`) at once, before anything runs. That dataset's labels are a private,
read-only copy, so once found in range for a rule the source keeps the verdict
(`ArraySource.labels_checked`): it then vouches for every batch drawn from it, in this
run and later ones, and they are not read again (docs/design.md §6).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["LabelChecks"]

_DATASET = "the dataset (fl.data.arrays)"


class LabelChecks:
    """The label checks of one run; the rule (`LabelRule` or None) is passed in, as the
    model checks find it (`Checker`)."""

    def __init__(self) -> None:
        self.source: Any = None  # the run's data source
        self.host_labels: Any = None  # an in-memory dataset's labels, as the host holds them
        self.hold = False  # every label of the run's source is known to be in range

    def use(self, source: Any) -> None:
        """Checks from now on the labels of `source` (the run's data)."""
        self.source = source
        self.host_labels = getattr(source, "host_labels", None)

    def settle(self, rule: Any) -> bool:
        """Whether the source already vouches for its labels under `rule` (kept as `hold`)."""
        self.hold = rule is not None and rule in getattr(self.source, "labels_checked", ())
        return self.hold

    def dataset(self, rule: Any) -> None:
        """Checks a whole in-memory dataset's labels, unless it vouches for them already;
        found in range, the source keeps the verdict."""
        if self.host_labels is None or rule is None or self.hold:
            return
        self.batch(rule, (None, self.host_labels()), _DATASET)
        checked = getattr(self.source, "labels_checked", None)
        if checked is not None:
            checked.add(rule)
            self.hold = True

    def batch(self, rule: Any, batch: Any, where: str) -> None:
        """A batch's labels in their loss's range, unless the source vouches for them.

        Labels given as jax arrays are read too: a fused run reads them as it stacks its
        chunk, so an unfused run must refuse the same batches. Host read: the labels alone,
        which the user made before the run (nothing waits for a step)."""
        if rule is None or self.hold or not isinstance(batch, (tuple, list)) or len(batch) != 2:
            return
        labels = batch[1]
        if not isinstance(labels, np.ndarray):
            if not (isinstance(labels, jax.Array) and labels.is_fully_addressable):
                return
            labels = np.asarray(labels)
        if labels.size:
            rule.check(labels, where)

    def chunk(self, rule: Any, chunk: Any, n: int, epoch: int, first_iteration: int) -> None:
        """A stacked chunk's `n` live batches' labels, in one pass; a bad one is named by
        its iteration."""
        if rule is None or self.hold or not isinstance(chunk, (tuple, list)) or len(chunk) != 2:
            return
        labels = chunk[1]
        if not isinstance(labels, np.ndarray) or labels.size == 0:
            return
        live = labels[:n]
        if rule.holds(live):
            return
        slot = int(np.argmax(rule.bad(live).reshape(n, -1).any(axis=1)))
        self.batch(rule, (None, live[slot]), f"epoch {epoch}, iteration {first_iteration + slot}")
