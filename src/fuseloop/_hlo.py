"""Reading XLA's optimized HLO text: how many fusions a compiled program holds
(`fl.diagnostics.count_fusions`, which the diagnostics report uses)."""

from __future__ import annotations

import re

__all__ = ["count_fusions"]

# An HLO instruction whose opcode is `fusion`: `%name = <type> fusion(<operands>), ...`.
_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\sfusion\(", re.MULTILINE)


def count_fusions(hlo_text: str) -> int:
    """Counts the `fusion` instructions in optimized HLO text (`compiled.as_text()`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda a: jnp.tanh(a + 1.0) * 2.0)
        >>> count_fusions(f.lower(jnp.ones(4)).compile().as_text()) >= 1
        True
    """
    if not isinstance(hlo_text, str):
        msg = f"count_fusions takes HLO text (str), got {type(hlo_text).__name__}: pass "
        raise TypeError(msg + "`jax.jit(f).lower(*args).compile().as_text()`")
    return len(_FUSION.findall(hlo_text))
