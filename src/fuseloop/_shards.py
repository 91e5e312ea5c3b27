"""Which rows of the data each process holds: per-process input and sharded datasets.

Under `jax.distributed` each process feeds only its share of every global batch
(`local_rows`, `local_indices`), and `assemble_global` builds the global batch (or chunk of
batches) from the shares with the mesh's batch sharding. A device-resident dataset is
stored the same way (`place_rows`): sharded along its example axis, each device holding
only its rows. With one process every function here is cheap and needs no set-up.
See docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "assemble_global",
    "local_indices",
    "local_rows",
    "place_rows",
    "process_block",
    "refuse_short_batch",
    "row_sharded",
    "take_rows",
]


# ----------------------------------------------------------------- per-process input
def local_rows(
    sharding: jax.sharding.Sharding, global_batch_size: int, batch_axis: int = 0
) -> slice:
    """The rows of every global batch this process feeds, under `sharding`.

    They are the rows the sharding places on this process's devices; they must be
    contiguous (a mesh built from `jax.devices()` in order gives that).

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> sharding = jax.NamedSharding(mesh, jax.P("data"))
        >>> local_rows(sharding, 8)
        slice(0, 8, None)
    """
    shape = [1] * (batch_axis + 1)
    shape[batch_axis] = global_batch_size
    starts, stops = [], []
    device: jax.Device  # (this jaxlib has no stub for the devices the map holds)
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        if device.process_index != jax.process_index():
            continue
        rows = index[batch_axis]
        starts.append(rows.start or 0)
        stops.append(global_batch_size if rows.stop is None else rows.stop)
    if not starts:
        raise ValueError(
            "sharding places no part of the batch on this process's devices; "
            "build the mesh from jax.devices() (all processes' devices)"
        )
    first, last = min(starts), max(stops)
    covered: set[int] = set()
    for start, stop in zip(starts, stops, strict=True):
        covered.update(range(start, stop))
    if covered != set(range(first, last)):
        raise ValueError(
            "this process's devices hold non-contiguous rows of the batch; order the mesh's "
            "devices by process (jax.make_mesh or jax.devices() order do)"
        )
    return slice(first, last)


def process_block(global_batch_size: int) -> slice:
    """This process's contiguous share of a global batch: rows [p*B/P, (p+1)*B/P).

    It is what `local_rows` gives for a "data" mesh built from `jax.devices()` (devices
    are ordered by process), and what a data source uses when it does not know the mesh.

    Example:
        >>> process_block(8)
        slice(0, 8, None)
    """
    count = jax.process_count()
    if global_batch_size % count:
        raise ValueError(
            f"batch_size={global_batch_size} does not divide over {count} processes; each "
            f"process feeds an equal share of every global batch, so use a multiple of "
            f"{count}"
        )
    share = global_batch_size // count
    return slice(jax.process_index() * share, (jax.process_index() + 1) * share)


def local_indices(
    global_indices: np.ndarray, batch_size: int, sharding: jax.sharding.Sharding | None = None
) -> np.ndarray:
    """This process's part of the example indices of one global batch.

    `fl.data.arrays` given the full arrays calls this for each batch, so every process
    keeps the global order a single process would use and feeds only its own rows (those
    `sharding` places on its devices, or `process_block` without a sharding).

    Example:
        >>> local_indices(np.arange(8), 8)
        array([0, 1, 2, 3, 4, 5, 6, 7])
    """
    if jax.process_count() == 1:
        return global_indices
    refuse_short_batch(len(global_indices), batch_size)
    rows = process_block(batch_size) if sharding is None else local_rows(sharding, batch_size)
    return global_indices[rows]


def refuse_short_batch(size: int, batch_size: int) -> None:
    """Refuses a host-fed batch of `size` examples, short of `batch_size`, under several
    processes: each feeds an equal share of every global batch. An `fl.data.arrays`
    dataset asks before its epoch's first batch, not at its last (after training the rest).

    Example:
        >>> refuse_short_batch(26, 32)  # one process: a short batch is fed as it is
    """
    if jax.process_count() == 1 or size == batch_size:
        return
    raise ValueError(
        f"data: the short last batch ({size} examples, drop_remainder=False) cannot be fed "
        f"from the host by {jax.process_count()} processes, each of which feeds its equal "
        f"share of batch_size={batch_size}; pass device=True (fl.data.arrays(..., "
        f"device=True) splits a short last batch over the devices when it divides), or "
        f"drop_remainder=True"
    )


def assemble_global(local_tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """The global arrays whose rows on this process are `local_tree`'s leaves.

    `sharding` is the mesh's batch sharding (a `NamedSharding` over the batch axis; for a
    chunk of K batches, over axis 1). Every process calls it with its own rows, in the same
    order. With one process it is `jax.device_put(local_tree, sharding)`.

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> sharding = jax.NamedSharding(mesh, jax.P("data"))
        >>> assemble_global({"x": np.ones((4, 2))}, sharding)["x"].shape
        (4, 2)
    """
    of = _per_leaf(sharding)
    if jax.process_count() == 1:
        return jax.device_put(local_tree, jax.tree.map(of, local_tree))
    return jax.tree.map(lambda leaf: _assemble_leaf(leaf, of(leaf)), local_tree)


def _per_leaf(sharding: Any) -> Callable[[Any], Any]:
    """A leaf's sharding: `sharding`, or a replicated one for a leaf without the batch axis
    it splits (a per-batch scalar; in a chunk, a vector of one per batch), which every
    device holds. The axis is read from `sharding` once, not once per leaf."""
    spec = getattr(sharding, "spec", None)
    axis = next((i for i, name in enumerate(spec or ()) if name is not None), None)
    if axis is None:
        return lambda leaf: sharding
    replicated = jax.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return lambda leaf: sharding if np.ndim(leaf) > axis else replicated


def _assemble_leaf(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        # Already global (a source that assembled its own batches): used as it is.
        if leaf.sharding != sharding:
            raise ValueError(
                f"a global array with sharding {leaf.sharding} was given where the mesh's "
                f"batch sharding {sharding} is expected; yield process-local numpy arrays "
                f"(fuseloop assembles them) or arrays with this sharding"
            )
        return leaf
    return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))


# ----------------------------------------------------------------- sharded datasets
def row_sharded(sharding: Any) -> bool:
    """Whether `sharding` splits an array's leading (example) axis over several devices.

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> row_sharded(jax.NamedSharding(mesh, jax.P("data"))), row_sharded(None)
        (False, False)
    """
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return False
    axes = sharding.spec[0]
    names = axes if isinstance(axes, tuple) else (axes,)
    return any(name is not None and sharding.mesh.shape[name] > 1 for name in names)


def place_rows(tree: Any, sharding: Any) -> Any:
    """`tree`'s host arrays on the devices, split along their leading (example) axis.

    With a `sharding` that splits axis 0 (`row_sharded`), each leaf becomes a global array
    whose rows are padded with zeros to a multiple of the shard count; every device holds
    only its block of rows, and each process moves only the rows of its own devices (the
    other rows of the host arrays it was given are never read). Any other `sharding`
    (None, replicated) is a plain `jax.device_put`.

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> placed = place_rows({"x": np.ones((5, 2))}, jax.NamedSharding(mesh, jax.P("data")))
        >>> placed["x"].shape, placed["x"].dtype
        ((5, 2), dtype('float32'))
    """
    if not row_sharded(sharding):
        return jax.device_put(tree, sharding)
    shards = sharding.mesh.size // _replicas(sharding)
    return jax.tree.map(lambda leaf: _place_leaf(np.asarray(leaf), sharding, shards), tree)


def _replicas(sharding: jax.sharding.NamedSharding) -> int:
    """How many devices hold each block of rows (mesh axes the rows are not split over)."""
    axes = sharding.spec[0]
    names = set(axes if isinstance(axes, tuple) else (axes,))
    copies = 1
    for name, size in sharding.mesh.shape.items():
        if name not in names:
            copies *= size
    return copies


def _place_leaf(leaf: np.ndarray, sharding: Any, shards: int) -> jax.Array:
    n = leaf.shape[0]
    padded = -(-n // shards) * shards
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)

    def rows(index: tuple[slice, ...] | None) -> np.ndarray:
        # Called once per device of this process, for that device's block of rows.
        assert index is not None  # a sharded (not fully replicated) array has an index
        start, stop, _ = index[0].indices(padded)
        block = np.asarray(leaf[start : min(stop, n)], dtype)
        if stop > n:  # padding rows: never gathered (every index is below n)
            pad = np.zeros((stop - max(start, n),) + leaf.shape[1:], dtype)
            block = np.concatenate([block, pad])
        return block[(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback((padded,) + leaf.shape[1:], sharding, rows)


def take_rows(leaf: Any, index: Any) -> Any:
    """`leaf[index]`, bit for bit, also when `leaf`'s rows are split over devices; jittable.

    XLA gathers from a row-split array by having each device take the rows it holds,
    zeros elsewhere, and summing over the devices. The sum is exact for every value but
    -0.0, which it turns into +0.0; gathering the float bits as unsigned integers keeps it.

    Example:
        >>> take_rows(jnp.array([1.0, -0.0, 3.0]), jnp.array([1, 0])).tolist()
        [-0.0, 1.0]
    """
    dtype = jnp.dtype(leaf.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return leaf[index]
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
    taken = jax.lax.bitcast_convert_type(leaf, bits)[index]
    return jax.lax.bitcast_convert_type(taken, dtype)
