"""A run's label checks: labels against their loss's rule (`_label_rule.LabelRule`).

Batches and chunks are checked as they arrive, and an in-memory dataset's labels
(`fl.data.arrays`) at once, before anything runs. That dataset's labels are a private,
read-only copy, so once found in range for a rule the source keeps the verdict
(`ArraySource.labels_checked`): it then vouches for every batch drawn from it, in this
run and later ones, and they are not read again (docs/design.md §6).

The class metrics' rule (`_class_labels.ClassLabels`, found with the model's run-start
warnings) is held the same way, beside the loss's: an in-memory dataset's labels (or a
list of batches') at the run's start, other data's batch by batch (`classes`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._class_labels import readable

__all__ = ["LabelChecks", "labels_of"]

_DATASET = "the dataset (fl.data.arrays)"


class LabelChecks:
    """The label checks of one run; the rule (`LabelRule` or None) is passed in, as the
    model checks find it (`Checker`)."""

    def __init__(self) -> None:
        self.source: Any = None  # the run's data source
        self.host_labels: Any = None  # an in-memory dataset's labels, as the host holds them
        self.hold = False  # every label of the run's source is known to be in range
        self.class_rule: Any = None  # the class metrics' rule, where batches must be read

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

    def classes(self, rule: Any, all_labels: Any, first: Any) -> None:
        """Holds the run's labels to the class metrics' `rule` (`ClassLabels`, or None):
        all at once where `all_labels` (`labels_of`) reads them, else the first batch
        now and each later one as it arrives. A dataset found to hold keeps the verdict."""
        checked = getattr(self.source, "labels_checked", None)
        if rule is None or (checked is not None and rule in checked):
            return
        labels = all_labels() if all_labels is not None else None
        if labels is None:
            self.class_rule = rule
            self._check(rule, first, "the run's first batch")
            return
        rule.check(labels, "the run's labels (read whole at its start)")
        if checked is not None:
            checked.add(rule)

    def batch(self, rule: Any, batch: Any, where: str) -> None:
        """A batch's labels in their loss's range, unless the source vouches for them, and
        under the class metrics' rule where it is read batch by batch.

        Labels given as jax arrays are read too: a fused run reads them as it stacks its
        chunk, so an unfused run must refuse the same batches. Host read: the labels alone,
        which the user made before the run (nothing waits for a step)."""
        if rule is not None and not self.hold:
            self._check(rule, batch, where)
        if self.class_rule is not None:
            self._check(self.class_rule, batch, where)

    @staticmethod
    def _check(rule: Any, batch: Any, where: str) -> None:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            return
        labels = batch[1]
        if not isinstance(labels, np.ndarray):
            if not (isinstance(labels, jax.Array) and labels.is_fully_addressable):
                return
            labels = np.asarray(labels)
        if labels.size:
            rule.check(labels, where)

    def chunk(self, rule: Any, chunk: Any, n: int, epoch: int, first_iteration: int) -> None:
        """A stacked chunk's `n` live batches' labels, in one pass per rule; a bad one is
        named by its iteration."""
        if not isinstance(chunk, (tuple, list)) or len(chunk) != 2:
            return
        labels = chunk[1]
        if not isinstance(labels, np.ndarray) or labels.size == 0:
            return
        live = labels[:n]
        for each in (None if self.hold else rule, self.class_rule):
            if each is None or each.holds(live):
                continue
            slot = int(np.argmax(each.bad(live).reshape(n, -1).any(axis=1)))
            where = f"epoch {epoch}, iteration {first_iteration + slot}"
            self._check(each, (None, live[slot]), where)


def labels_of(data: Any) -> Any:
    """A callable returning all the labels of in-memory `data` (`fl.data.arrays`, or a list
    or tuple of `(x, y)` batches whose labels are arrays alike but for their length, else
    None), for the class metrics' rule to read at once; None for other data."""
    if hasattr(data, "host_labels"):
        return data.host_labels
    if not isinstance(data, (list, tuple)) or len(data) < 2:
        return None

    def read() -> Any:  # only where a class metrics' rule applies
        pairs = [batch for batch in data if isinstance(batch, (tuple, list)) and len(batch) == 2]
        labels = [y for y in (readable(pair[1]) for pair in pairs) if y is not None and y.ndim]
        if len(labels) < len(data) or len({y.shape[1:] for y in labels}) != 1:
            return None  # (one unlike the first batch is refused by the batch checks)
        return np.concatenate(labels)

    return read
