"""What to tell a user whose model asks for randomness fuseloop does not supply: the rng
streams and keys each adapter passes, while training and while evaluating."""

from __future__ import annotations

import re
from typing import Any

from ._equinox import from_equinox
from ._functions import from_functions
from ._model_fit_advice import first_line
from .models import from_nnx, linen

__all__ = ["rng_error"]


def rng_error(program: Any, error: BaseException, applying: str) -> ValueError:
    """The ValueError for `program`'s model asking for randomness while `applying`."""
    model = program.model
    plain = isinstance(model, from_functions)  # a pair of functions: no class to name
    name = "its apply_fn" if plain else type(getattr(model, "module", model)).__name__
    failure = f"{applying} fails with {first_line(error)}. x is not the problem"
    training = program.kind == "trainer"
    if isinstance(model, linen):
        return ValueError(_linen(name, error, failure, training))
    if isinstance(model, from_nnx):
        return ValueError(
            f"model: {name} needs an rng it was not given: {failure}; fuseloop passes no "
            f"rng to an nnx module, whose layers draw from the nnx.Rngs they were built "
            f"with, so give the layer rngs= when you build it (e.g. nnx.Dropout(0.3, "
            f"rngs=rngs))"
        )
    if isinstance(model, from_equinox):
        return ValueError(
            f"model: {name} needs a random key that fuseloop does not supply: {failure}; "
            f"fuseloop passes an equinox module its key as `key` while training (one per "
            f"example) and none where `key` has a default when it evaluates: take the key "
            f"as `key`, and draw from it only when one is given (equinox's Dropout in "
            f"inference mode draws nothing)"
        )
    if not training:
        return ValueError(
            f"model: {name} draws randomness in evaluation, but fuseloop passes no key "
            f"when it evaluates (the rng is None, the train flag off): {failure}; draw it "
            f"only while training (behind the train flag, e.g. `if is_training:`), or "
            f"evaluate with fl.loop"
        )
    return ValueError(
        f"model: {name} needs a random key that fuseloop does not supply: {failure}; "
        f"fuseloop passes a key only while training, to an apply_fn parameter named `rng` "
        f"(or haiku's second parameter), so draw the randomness from that key, or write "
        f"the step with fl.loop"
    )


def _linen(name: str, error: BaseException, failure: str, training: bool) -> str:
    found = re.search(r'PRNG for "([^"]+)"', str(error))
    stream = f"the rng stream {found.group(1)!r}" if found else "an rng stream"
    if training:
        return (
            f"model: {name} asks for {stream}, but fuseloop's trainer passes only the "
            f"'dropout' stream: {failure}; draw that randomness from the 'dropout' stream "
            f"(self.make_rng('dropout')), or write the step yourself with fl.loop to pass "
            f"other streams"
        )
    return (
        f"model: {name} asks for {stream} in evaluation, but fuseloop passes no rng when it "
        f"evaluates (the model's train flag off): {failure}; make the model deterministic "
        f"when the flag is off (e.g. nn.Dropout(rate, deterministic=not train)), or "
        f"evaluate with fl.loop"
    )
