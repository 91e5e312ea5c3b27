"""Parameter names that read as a PRNG key: those a plain apply function receives the
step's key by, and those it would leave at their default because fuseloop passes no key
there (`_functions.py` asks)."""

from __future__ import annotations

import re

__all__ = ["RNG_NAMES", "looks_like_a_key"]

RNG_NAMES = ("rng", "key", "rng_key", "prng_key", "dropout_rng")

# Spellings that can only mean a key (`dropout_key`, `noise_rng`, flax's `rngs`) but are
# none of RNG_NAMES, so a plain apply function's parameter of that name keeps its default.
# Not names that may mean something else (`cache_key`, `random_seed`).
_LOOKS_LIKE_A_KEY = re.compile(r"^rngs$|_(rng|rngs)$|^(dropout|noise|sample|init)_key$")


def looks_like_a_key(name: str) -> bool:
    """Whether `name` reads as a PRNG key though it is none of RNG_NAMES."""
    return bool(_LOOKS_LIKE_A_KEY.search(name))
