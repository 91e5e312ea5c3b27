"""What a trainer says of its model at a run's start, on the host, before anything trains.

* A model that sows a "losses" collection (`_step.warn_sown_losses`).
* A model whose outputs are already probabilities (a final sigmoid or softmax, as a Keras
  model ends) under a built-in cross-entropy, which takes logits as optax's losses do: it
  would apply the sigmoid or softmax a second time, and accuracy would threshold at 0, so
  both would be silently wrong. Checked once per Loop (its program cache), by one forward
  pass of the initial variables over the first batch.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ._step import split_batch, warn_sown_losses
from ._warn import warn

__all__ = ["warn_about_model"]

# The built-in losses that take logits, and the function each applies to them.
_APPLIES = {
    "binary_cross_entropy": "sigmoid",
    "categorical_cross_entropy": "softmax",
    "sparse_categorical_cross_entropy": "softmax",
}
_CHECKED = "probabilities checked"


def warn_about_model(
    program: Any, step_state: Any, first_batch: Any, verdicts: dict[Any, Any], solo: bool
) -> None:
    """The run-start warnings about a trainer's model (`verdicts`: the Loop's cache of
    checks already made; `solo`: not a population, whose variables have a member axis)."""
    warn_sown_losses(program, step_state)
    applies = _APPLIES.get(program.loss_name or "") if isinstance(program.loss, str) else None
    if program.kind != "trainer" or applies is None or not solo or _CHECKED in verdicts:
        return
    verdicts[_CHECKED] = True
    x, _ = split_batch(first_batch)
    try:  # one eager forward pass, in evaluation mode
        output = program.model.forward(step_state["params"], x, train=False, rng=None)[0]
    except Exception:  # noqa: BLE001 - the run's own checks report a model that fails
        return
    if not hasattr(output, "dtype") or not jnp.issubdtype(output.dtype, jnp.floating):
        return  # several outputs, or not floats: the loss's own checks name those
    if _looks_like(np.asarray(output, np.float32), applies):
        warn(
            f"model: its outputs on the first batch look like probabilities (every value in "
            f"(0, 1){', each row summing to 1' if applies == 'softmax' else ''}), but the "
            f"built-in loss '{program.loss}' takes logits, as optax's losses do: it applies "
            f"{applies} itself, so the loss would see {applies}({applies}(...)) and accuracy "
            f"would threshold probabilities as logits. Remove the model's final {applies} "
            f"(apply jax.nn.{applies} to fl.predict's outputs instead), or pass a loss of "
            f"your own that takes probabilities",
            UserWarning,
        )


def _looks_like(output: np.ndarray, applies: str) -> bool:
    """Whether `output` holds what `applies` (sigmoid or softmax) returns: values strictly
    inside (0, 1) (a logit model's outputs at initialisation straddle 0), and for softmax
    rows of at least two classes summing to 1."""
    if output.size < 2 or not np.all(np.isfinite(output)):
        return False
    inside = bool(np.all((output > 0) & (output < 1)))
    if applies == "sigmoid" or not inside:
        return inside
    if output.ndim < 1 or output.shape[-1] < 2:
        return False
    return bool(np.all(np.abs(np.sum(output, axis=-1) - 1.0) < 1e-3))
