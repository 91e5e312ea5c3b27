"""Parameter names that read as a PRNG key: which a plain apply function receives the
step's key by, and which a model's call would leave at their default because fuseloop
passes no key there (`_functions.py` for plain functions; linen and nnx modules, whose
`__call__` is called with x and its flags only, in `warn_key_parameters`)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from ._warn import warn

__all__ = ["RNG_NAMES", "looks_like_a_key", "warn_key_parameters"]

RNG_NAMES = ("rng", "key", "rng_key", "prng_key", "dropout_rng")

# Spellings that can only mean a key (`dropout_key`, `noise_rng`, flax's `rngs`) but are
# none of RNG_NAMES, so a plain apply function's parameter of that name keeps its default.
# Not names that may mean something else (`cache_key`, `random_seed`).
_LOOKS_LIKE_A_KEY = re.compile(r"^rngs$|_(rng|rngs)$|^(dropout|noise|sample|init)_key$")


def looks_like_a_key(name: str) -> bool:
    """Whether `name` reads as a PRNG key though it is none of RNG_NAMES."""
    return bool(_LOOKS_LIKE_A_KEY.search(name))


def warn_key_parameters(module: Any, fix: str) -> None:
    """Warns of a parameter of `module.__call__` past x that reads as a PRNG key and
    defaults to None: fuseloop calls the module with x and its flags only, so it never
    receives a key (a VAE's sampling, dropout, stay off). `fix`: how this kind of
    module draws its randomness instead."""
    try:
        parameters = list(inspect.signature(type(module).__call__).parameters.values())
    except (TypeError, ValueError):
        return
    for parameter in parameters[2:]:  # past self and x
        keyed = parameter.name in RNG_NAMES or looks_like_a_key(parameter.name)
        if keyed and parameter.default is None:
            warn(
                f"model: {type(module).__name__}.__call__'s parameter {parameter.name!r} "
                f"reads as a PRNG key, but fuseloop calls the module with x and its "
                f"train/eval flags only, so it always keeps its default None (sampling or "
                f"dropout off): {fix}",
                UserWarning,
            )
