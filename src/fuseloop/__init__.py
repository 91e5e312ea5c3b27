"""fuseloop: a fused training loop for JAX.

K training steps run inside one device-side loop; the host synchronizes once per chunk
instead of once per batch, and every callback, metric, log line and halt behaves exactly
as in the plain loop.

Example:
    >>> import fuseloop as fl, optax
    >>> loop = fl.trainer(fl.models.mlp([32, 10]), "sparse_categorical_cross_entropy",
    ...                   optax.adam(1e-3))

The examples in fuseloop's docstrings take these names as given (as numpy's take `np`):
`fl`, `np`, `jnp`, `jax`, `optax`; `model = fl.models.mlp([8, 3])`; `loop =
fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.1))`; `batches`, a list
of 4 `(x float32[8, 4], y int32[8])` pairs with labels in 0..2, and `val_batches`, 2 more.
"""

from . import _distributed

_distributed.initialize_from_environment()  # first: before any module touches a jax backend
from . import data, diagnostics, handlers, models, types
from ._checkpoint import load_state, save_state
from ._distributed import all_processes, is_main_process, main_process_only
from ._events import Event
from ._factories import evaluator, loop, trainer
from ._fusion import FusionError
from ._loop import Loop
from ._pairwise import pairwise
from ._predict import predict
from ._state import State
from .handlers.plot import plot_history

__version__ = "0.1.0"

__all__ = [
    "Event",
    "FusionError",
    "Loop",
    "State",
    "all_processes",
    "data",
    "diagnostics",
    "evaluator",
    "handlers",
    "is_main_process",
    "load_state",
    "loop",
    "main_process_only",
    "models",
    "pairwise",
    "plot_history",
    "predict",
    "save_state",
    "trainer",
    "types",
]
