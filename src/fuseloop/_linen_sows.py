"""What a flax.linen module sows while a training step is traced, where flax would drop
the value in silence: `sow` asks its scope, not the module, whether the collection may
change, and returns False where it may not. fuseloop trains with the collections the
module's init made, so a value sown into another stays unseen (the README's tour: collections)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn

__all__ = ["RECORDING", "recording_sows", "train_only_sows"]

# Held while a training pass records what it asks of flax; it swaps flax's methods.
RECORDING = threading.RLock()  # reentrant: a model may build another inside its call


@contextlib.contextmanager
def recording_sows(counted: Callable[[str], bool]) -> Iterator[list[str]]:
    """The collection of each `sow` the block makes that `counted` picks, in a list the
    block fills (trace time only; one recording at a time, of this thread's sows alone:
    the patch is the process's, and another thread may be applying a module of its own)."""
    sown: list[str] = []
    with RECORDING:
        original, recorder = nn.Module.sow, threading.get_ident()

        def sowing(module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == recorder and counted(name):
                sown.append(name)
            return original(module, name, *args, **kwargs)

        nn.Module.sow = sowing  # type: ignore[method-assign,assignment]
        try:
            yield sown
        finally:
            nn.Module.sow = original  # type: ignore[method-assign]


def train_only_sows(module: Any, names: list[str]) -> str:
    """What is wrong with a module with a train flag that sows, while training, into
    collections the variables it trains with do not hold, and the fix."""
    return (
        f"model: {type(module).__name__} sows into {names} while training, collections "
        f"the variables it trains with do not hold (fuseloop's init runs the model with the "
        f"train flag off; variables you pass may lack them too): flax would drop every value "
        f"sown there. Sow on both paths (the value unused when not training), or pass "
        f"variables that hold them, e.g. run(data, module.init({{'params': key, 'dropout': "
        f"key}}, x, train=True)); keep one value per step (sow(..., init_fn=..., "
        f"reduce_fn=lambda old, new: new))"
    )
