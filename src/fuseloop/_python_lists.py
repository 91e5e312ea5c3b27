"""Python lists where arrays belong in a batch or in `fl.data.arrays`' x and y: of numbers
(no batch axis anywhere), of per-example arrays or records (to be stacked), of strings
(which no device holds); each refused with the array it should be."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = [
    "check_python_lists",
    "is_number_list",
    "number_lists",
    "refuse_per_example_lists",
    "refuse_python_list",
]


def is_number_list(value: Any) -> bool:
    """A list or tuple of Python numbers (or 0-d arrays): no batch axis anywhere. Not one
    of strings (ids, file names), which no device holds (`no_device_dtype` names them)."""
    leaves = jax.tree.leaves(value)
    # The source turns Python numbers into 0-d arrays; neither has a batch axis.
    return (
        isinstance(value, (list, tuple))
        and bool(leaves)
        and all(np.ndim(leaf) == 0 and not _text(leaf) for leaf in leaves)
    )


def _text(leaf: Any) -> bool:
    """A string, or a 0-d array of one (the source makes each Python value an array)."""
    kind = getattr(getattr(leaf, "dtype", None), "kind", "")
    return isinstance(leaf, (str, bytes)) or kind in ("U", "S")


def number_lists(tree: Any, name: str) -> list[tuple[str, Any]]:
    """`(path, list)` of each outermost Python list or tuple of numbers in `tree` (`x`, or a
    dict holding `x["ids"] = [0, 1, ...]`, or nested lists from `.tolist()`), spelled as the
    user would index it: one error names the list, not each of its numbers.

    Example:
        >>> [path for path, _ in number_lists({"a": np.ones(2), "ids": [0, 1]}, "x")]
        ["x['ids']"]
    """
    if is_number_list(tree):
        return [(name, tree)]
    return [found for path, child in _children(tree, name) for found in number_lists(child, path)]


def refuse_text_list(part: Any, name: str, where: str = "") -> None:
    """x or y holding a Python list of strings (ids, file names): no device holds them."""
    for path, texts in _text_lists(part, name)[:1]:
        leaves = jax.tree.leaves(texts)
        text = np.asarray(next(filter(_text, leaves))).item()  # a 0-d array in a batch
        held = (
            "strings" if all(map(_text, leaves)) else f"strings mixed with numbers (e.g. {text!r})"
        )
        raise ValueError(
            f"{where}{path} is a Python {type(texts).__name__} of {held}, which no device "
            f"holds: map them to numbers first (e.g. ids, codes = np.unique({path}, "
            f"return_inverse=True)), or keep them outside the data"
        )


def _text_lists(tree: Any, name: str) -> list[tuple[str, Any]]:
    """`(path, list)` of each outermost list or tuple in `tree` of scalars, some strings."""
    leaves = jax.tree.leaves(tree)
    scalars = leaves and all(np.ndim(leaf) == 0 for leaf in leaves)
    if isinstance(tree, (list, tuple)) and scalars and any(map(_text, leaves)):
        return [(name, tree)]
    return [found for path, child in _children(tree, name) for found in _text_lists(child, path)]


def per_example_lists(tree: Any, name: str, n: int) -> list[tuple[str, Any]]:
    """`(path, list)` of each Python list in `tree` of `n` arrays or records of one form
    (`list(x)`, `[{"a": row}, ...]`): the examples split into a list, where
    `fl.data.arrays` takes them stacked on axis 0. `n` is what the other arrays hold."""
    if isinstance(tree, list) and len(tree) == n > 1:  # a tuple: several inputs, say
        forms = {jax.tree.structure(item) for item in tree}
        if len(forms) == 1 and all(np.ndim(leaf) >= 1 for leaf in jax.tree.leaves(tree[0])):
            return [(name, tree)]
    return [
        found
        for path, child in _children(tree, name)
        for found in per_example_lists(child, path, n)
    ]


def _children(tree: Any, name: str) -> list[tuple[str, Any]]:
    """`(path, child)` of a dict's or a list's items, spelled as the user would index them."""
    if isinstance(tree, dict):
        return [(f"{name}[{key!r}]", child) for key, child in tree.items()]
    if isinstance(tree, (list, tuple)):
        return [(f"{name}[{i}]", child) for i, child in enumerate(tree)]
    return []


def refuse_python_list(part: Any, name: str) -> None:
    """`fl.data.arrays`' x or y as a Python list (or holding one): of records (dicts, one
    per example) or of numbers; either is refused with the array it should be."""
    refuse_text_list(part, name)
    found = number_lists(part, name)
    if not found:
        return
    path, numbers = found[0]
    kind = type(numbers).__name__
    if isinstance(numbers[0], dict):
        raise ValueError(
            f"{path} is a Python {kind} of dicts (one per example?); fl.data.arrays takes a "
            f"dict of arrays, each with the examples on axis 0: "
            f"{{k: np.stack([r[k] for r in {path}]) for k in {path}[0]}}"
        )
    raise ValueError(
        f"{path} is a Python {kind} of numbers; pass an array with the examples on axis 0, "
        f"e.g. np.asarray({path}, np.float32) (integer labels: np.int32)"
    )


def refuse_per_example_lists(x: Any, y: Any, sizes: dict[str, int]) -> None:
    """Where x's and y's leaves disagree on the examples because one of them is a Python
    list of per-example arrays or records (`list(x)`), says to stack it."""
    for name, part in (("x", x), ("y", y)):
        for n in sorted(set(sizes.values()), reverse=True):
            for path, items in per_example_lists(part, name, n):
                kind, what = type(items).__name__, type(items[0]).__name__
                stack = (
                    f"{{k: np.stack([r[k] for r in {path}]) for k in {path}[0]}}"
                    if isinstance(items[0], dict)
                    else f"np.stack({path})"
                )
                raise ValueError(
                    f"{path} is a Python {kind} of {n} {what}s (one per example?); "
                    f"fl.data.arrays takes arrays with the examples on axis 0: {stack}"
                )


def check_python_lists(batch: Any, where: str) -> None:
    """x or y given as (nested) Python lists of numbers, or holding one (a dict's
    `"ids": [...]`): one error naming the list, not one per number."""
    for name, part in zip(("x", "y"), batch, strict=True):
        refuse_text_list(part, name, f"data: {where}: ")
        for path, numbers in number_lists(part, name)[:1]:
            count = len(jax.tree.leaves(numbers))
            raise ValueError(
                f"data: {where}: {path} is a Python {type(numbers).__name__} of {count} "
                f"numbers, but x and y must be arrays with the examples on axis 0. Convert "
                f"them, e.g. np.asarray({path}, np.float32) (integer labels: np.int32), or "
                f"pass fl.data.arrays(x, y, batch_size=...)"
            )
