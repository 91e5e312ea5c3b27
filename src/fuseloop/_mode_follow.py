"""Layers that did not follow the training or evaluation mode fuseloop set, in a module
whose `__call__` takes a flag of its own that fuseloop does not recognise (nnx, equinox).

fuseloop switches an nnx module with `.train()`/`.eval()` and an equinox one with
`eqx.nn.inference_mode`, and passes the recognised flags (`TRAIN_FLAGS`) by name. A flag
of another name (`is_train`, `use_dropout`) stays at its default, and when the call hands
it on to Dropout or BatchNorm (`deterministic=not is_train`) those layers do what the
default says in training and in evaluation alike: a silent change of the model. Only a
module with such a flag is watched, and only while its step is traced (a compiled step
pays nothing): a layer whose mode the call set on purpose (a BatchNorm frozen for
fine-tuning) in a module without one is the user's choice.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._linen import TRAIN_FLAGS, ModelModeError
from ._nnx_checks import raw_value, rng_counts

__all__ = ["nnx_mode_watch", "refuse_unfollowed", "unfollowed_mode", "unrecognised_flags"]


def unrecognised_flags(module: Any) -> list[str]:
    """`name=default` for each parameter of `module`'s `__call__` after x with a bool
    default that is not a flag fuseloop passes (`TRAIN_FLAGS`).

    Example:
        >>> class Net:
        ...     def __call__(self, x, is_train: bool = False, train: bool = False): ...
        >>> unrecognised_flags(Net())
        ['is_train=False']
    """
    try:
        parameters = list(inspect.signature(type(module).__call__).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    return [
        f"{p.name}={p.default}"
        for p in parameters
        if isinstance(p.default, bool) and p.name not in TRAIN_FLAGS
    ]


def unfollowed_mode(
    module: Any, flags: list[str], layers: list[str], train: bool
) -> ModelModeError:
    """The ModelModeError for `layers` that did not follow the mode of `train`."""
    mode = "training" if train else "evaluation"
    return ModelModeError(
        f"model: {type(module).__name__}.__call__ takes {', '.join(flags)}, a flag fuseloop "
        f"does not recognise, so it calls the module without it; called so in {mode}, "
        f"{'; '.join(layers)}. Name the flag one fuseloop passes (train, training, "
        f"is_training, deterministic, use_running_average or inference: e.g. `def "
        f"__call__(self, x, train: bool = False)`), or let the layers follow the mode "
        f"fuseloop sets (.train()/.eval(), eqx.nn.inference_mode) by not passing them a "
        f"mode in the call"
    )


def nnx_mode_watch(module: Any) -> dict[str, Any]:
    """What an nnx module's Dropout and BatchNorm layers hold before a call: each
    BatchNorm's running statistics (as objects: a write replaces them) and mode, the
    paths of Dropout layers set to drop, and every rng stream's count."""
    from flax import nnx

    norms, drops = {}, []
    for path, sub in nnx.iter_graph(module):
        name = ".".join(map(str, path)) or "the module"
        if isinstance(sub, nnx.BatchNorm):
            stats = (raw_value(sub.mean), raw_value(sub.var))
            norms[name] = (sub, stats, sub.use_running_average)
        elif isinstance(sub, nnx.Dropout) and sub.rate:
            drops.append((name, sub.deterministic))
    return {"norms": norms, "drops": drops, "counts": rng_counts(module)}


def refuse_unfollowed(
    watch: dict[str, Any] | None, module: Any, flags: list[str], train: bool
) -> None:
    """Raises `unfollowed_mode` where a layer of `watch` (None: not watched) did not follow
    `train`'s mode in the call just made."""
    ignored = [] if watch is None else _nnx_unfollowed(watch, module, train)
    if ignored:
        raise unfollowed_mode(module, flags, ignored, train)


def _nnx_unfollowed(watch: dict[str, Any], module: Any, train: bool) -> list[str]:
    """The layers of `watch` (taken before the call) that did not follow `train`'s mode."""
    out = []
    for name, (sub, stats, running) in watch["norms"].items():
        now = (raw_value(sub.mean), raw_value(sub.var))
        written = any(a is not b for a, b in zip(now, stats, strict=True))
        if train and running is False and not written:
            out.append(f"BatchNorm {name} left its running statistics as they were")
        elif not train and written:
            out.append(f"BatchNorm {name} normalised with the batch's own statistics")
    counts = rng_counts(module)
    drew = any(counts[p][1] is not c for p, (_, c) in watch["counts"].items() if p in counts)
    dropping = [name for name, held in watch["drops"] if held is False]
    if train and dropping and not drew:
        out.append(f"Dropout {dropping[0]} drew no mask")
    elif not train and watch["drops"] and drew:
        out.append(f"Dropout {watch['drops'][0][0]} drew a mask")
    return out
