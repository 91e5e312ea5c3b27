"""Channel-last convolutions in fuseloop's own programs on CPU (docs/design.md §10).

XLA:CPU runs a convolution on its fast path only in the channel-last form: input
`(batch, spatial..., feature)`, kernel `(spatial..., in, out)`, output like the input. A
standalone program reaches that form by itself, whatever dimension numbers the convolution
has (the kernel gradient autodiff builds swaps batch and feature, an equinox model is
channel-first): XLA transposes the operands. Inside a loop body it does not, and every such
convolution takes the generic path, 10-25x slower. Every fuseloop step runs inside a device
loop, so fuseloop writes those transposes itself when it lowers its own programs: the same
convolution, in the form a standalone program would have given it (the zoo's CNN trains
bitwise like a plain jitted step).

Only fuseloop's programs change: the rule recognises them by name (`named`, every one is a
function `fuseloop_*`); any other program, the user's included, lowers as JAX lowers it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax
from jax.interpreters import mlir

__all__ = ["named", "install", "channel_last"]

PREFIX = "fuseloop_"
_MODULE = f"jit_{PREFIX}"  # what jax.jit names the module of a function `fuseloop_*`
_installed = False


def named(fn: Callable[..., Any], role: str) -> Callable[..., Any]:
    """`fn` as a function `fuseloop_<role>`: a program jitted from it is one of fuseloop's
    (the lowering is registered on the first call). `fn` itself is left as it was.
    """
    install()

    @functools.wraps(fn)
    def program(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = PREFIX + role
    return program


def channel_last(rank: int) -> lax.ConvDimensionNumbers:
    """The dimension numbers of XLA:CPU's fast convolution for operands of `rank` axes."""
    spatial = tuple(range(1, rank - 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, rank - 1, *spatial),
        rhs_spec=(rank - 1, rank - 2, *range(rank - 2)),
        out_spec=(0, rank - 1, *spatial),
    )


def install() -> None:
    """Registers the CPU lowering once (later calls do nothing).

    Where this JAX keeps its lowering rules elsewhere than expected, nothing is registered:
    fuseloop's programs then lower as any other (the same results, slower on CPU).
    """
    global _installed
    if _installed:
        return
    _installed = True
    found = _current_cpu_rule()
    if found is None:
        return
    previous, inline = found

    def lower(ctx: Any, lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> Any:
        rank = len(dimension_numbers.lhs_spec)
        if dimension_numbers == channel_last(rank) or not _in_fuseloop_program(ctx):
            return previous(ctx, lhs, rhs, dimension_numbers=dimension_numbers, **params)
        rewritten = functools.partial(_as_channel_last, numbers=dimension_numbers, params=params)
        return mlir.lower_fun(rewritten, multiple_results=False)(ctx, lhs, rhs)

    mlir.register_lowering(lax.conv_general_dilated_p, lower, platform="cpu", inline=inline)


def _as_channel_last(lhs: Any, rhs: Any, *, numbers: Any, params: dict[str, Any]) -> Any:
    """The convolution `numbers` describes, computed in the channel-last form.

    Transposing keeps each axis's role (batch, feature, the spatial axes in their order),
    so strides, padding, dilations and group counts mean what they meant.
    """
    lhs_spec, rhs_spec, out_spec = numbers
    lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    out = lax.conv_general_dilated_p.bind(
        lhs, rhs, dimension_numbers=channel_last(len(lhs_spec)), **params
    )
    # Axis k of `out` belongs at position order[k] of the result.
    order = (out_spec[0], *out_spec[2:], out_spec[1])
    return lax.transpose(out, tuple(int(k) for k in np.argsort(order)))


def _in_fuseloop_program(ctx: Any) -> bool:
    attributes = ctx.module_context.module.operation.attributes
    if "sym_name" not in attributes:
        return False
    return str(attributes["sym_name"]).strip('"').startswith(_MODULE)


def _current_cpu_rule() -> tuple[Callable[..., Any], bool] | None:
    """The rule JAX lowers a CPU convolution with, and its `inline` flag; None if this JAX
    keeps its rules elsewhere."""
    try:
        from jax._src.interpreters import mlir as registry  # noqa: PLC0415 (private: guarded)

        entry = registry._platform_specific_lowerings["cpu"].get(lax.conv_general_dilated_p)
        if entry is None:
            entry = registry._lowerings.get(lax.conv_general_dilated_p)
    except (ImportError, AttributeError, KeyError, TypeError):
        return None
    rule: Any = getattr(entry, "rule", entry)  # older JAX keeps the bare rule
    return (rule, bool(getattr(entry, "inline", True))) if callable(rule) else None
