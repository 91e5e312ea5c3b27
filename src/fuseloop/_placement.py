"""Where arrays live: one device, or a mesh with a "data" axis (data parallelism).

Every host-to-device transfer of training data goes through `put_batch`/`put_chunk` and is
counted in `stats["h2d_transfers"]`; moving the initial state is not counted.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import OrderedDict
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._batch_checks import held_by_no_device
from ._prng_keys import holds_typed_keys, raw_keys
from ._shards import assemble_global

__all__ = [
    "Placement",
    "default_device_key",
    "device_dtype",
    "device_int",
    "device_signature",
    "on_one_device_set",
    "require_divides",
    "signature_of",
    "tree_bytes",
]

# The library's device constants, most recently used last; a long or many times resumed run
# meets a new epoch number each epoch, so the oldest are let go past `_KEPT_CONSTANTS`.
_DEVICE_INTS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_DEVICE_INTS_LOCK = threading.Lock()  # a prefetch thread may ask for one too
_KEPT_CONSTANTS = 256
_CANONICAL: dict[tuple[Any, bool], Any] = {}
# The effective host-to-device transfer guard (a caller's `jax.transfer_guard(...)`
# context or flag sets it too): read by name, as jax's config has no typed attribute.
_HOST_TO_DEVICE_GUARD = "jax_transfer_guard_host_to_device"
_NOTHING_TO_ALLOW = contextlib.nullcontext()


def device_dtype(leaf: Any) -> Any:
    """The dtype a host leaf has on the device: canonical, so float64 becomes float32 while
    64-bit mode is off; typed PRNG keys (nnx RNG streams) stay as they are."""
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    return _canonical(dtype)


def _canonical(dtype: Any) -> Any:
    """`canonicalize_dtype`, remembered per dtype and 64-bit mode (a run asks for every leaf
    of its first batch and its variables; the lookup costs a tenth of the call)."""
    key = (dtype, jax.config.read("jax_enable_x64"))
    canonical = _CANONICAL.get(key)
    if canonical is None:
        canonical = jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)
        _CANONICAL[key] = canonical
    return canonical


def device_signature(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """`(treedef, ((shape, device dtype), ...))`: what a compiled program specializes on."""
    leaves, treedef = jax.tree.flatten(tree)
    return signature_of(leaves, treedef)


def signature_of(leaves: list[Any], treedef: Any) -> tuple[Any, tuple[Any, ...]]:
    """`device_signature` of a tree already flattened into `leaves` and `treedef`."""
    return treedef, tuple(_leaf_spec(leaf) for leaf in leaves)


def _leaf_spec(leaf: Any) -> tuple[tuple[int, ...], Any]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and type(shape := getattr(leaf, "shape", None)) is tuple:
        return shape, _canonical(dtype)  # an array's attributes: np.shape costs more
    return np.shape(leaf), device_dtype(leaf)


def default_device_key() -> Any:
    """Where `device_put` and a program without arguments put their output now (the
    default device, None: jax's own choice)."""
    return getattr(jax.config, "jax_default_device", None)


def on_one_device_set(tree: Any) -> Any:
    """`tree` with its device arrays moved to the default device where they are committed
    to different devices, or the same in another order (a mesh run's params with a new
    layer put on one device), which no program takes together; the run then places them
    as any state. Otherwise `tree` itself (a tree spanning processes too: it cannot be
    gathered here).

    Example:
        >>> tree = {"w": jax.device_put(np.ones(2), jax.devices()[0])}
        >>> on_one_device_set(tree) is tree
        True
    """
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    placed = {_device_order(leaf.sharding) for leaf in arrays if leaf.committed}
    if len(placed) <= 1 or not all(leaf.is_fully_addressable for leaf in arrays):
        return tree
    device = default_device_key()
    if isinstance(device, str):  # a platform's name: its first device here
        device = jax.local_devices(backend=device)[0]
    if not isinstance(device, jax.Device):
        device = jax.local_devices()[0]
    return jax.device_put(tree, device)


def _device_order(sharding: Any) -> Any:
    """The devices a program taking an array of `sharding` runs on, in the order it
    compares them (a mesh's order), where the sharding tells it."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, Mesh):
        return tuple(mesh.devices.flat)
    return tuple(sorted(sharding.device_set, key=lambda device: device.id))


def tree_bytes(tree: Any) -> int:
    """The bytes `tree`'s leaves hold: arrays, tracers or shape-dtype structs alike.

    Example:
        >>> tree_bytes({"w": jax.ShapeDtypeStruct((3, 4), np.float32), "n": np.int8(1)})
        49
    """
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def device_int(value: int) -> Any:
    """A device int32 scalar holding `value`, kept and shared while among the recently used
    (`_kept_constant`; two threads missing it at once may each make one): no program
    donates it,
    and a transfer per run costs the host about 0.1-0.2 ms on a CPU (docs/design.md §6).
    Allowed under any transfer guard (the library's own constant, not the caller's data).
    """
    return _kept_constant((value, default_device_key()), lambda: np.int32(value))


def device_key(key: np.ndarray) -> Any:
    """A seed's raw key (a small read-only host array) on the device, made once per key and
    device as `device_int`'s scalars are: a resident epoch's order then moves nothing."""
    return _kept_constant((key.tobytes(), key.shape, default_device_key()), lambda: key)


def _kept_constant(key: tuple[Any, ...], host: Any) -> Any:
    """The device copy of `host()` under `key`, made once while it stays among the most
    recently used."""
    with _DEVICE_INTS_LOCK:
        kept = _DEVICE_INTS.get(key)
        if kept is not None:
            _DEVICE_INTS.move_to_end(key)
            return kept
    with jax.transfer_guard("allow"):
        kept = jax.device_put(host())
    with _DEVICE_INTS_LOCK:
        _DEVICE_INTS[key] = kept
        if len(_DEVICE_INTS) > _KEPT_CONSTANTS:
            _DEVICE_INTS.popitem(last=False)
    return kept


class Placement:
    """Puts the step state (replicated) and the data (batch axis sharded) on devices."""

    def __init__(self, mesh: Mesh | None, stats: dict[str, Any]):
        if mesh is None and jax.process_count() > 1:
            # Several processes form one global mesh (docs/distributed.md).
            mesh = Mesh(jax.devices(), ("data",))
        self.mesh, self.stats = mesh, stats
        if mesh is None:
            self._state = self._batch = self._chunk = None
            return
        if not isinstance(mesh, Mesh) or "data" not in mesh.axis_names:
            raise ValueError(
                f"mesh={mesh!r} must be a jax.sharding.Mesh with a 'data' axis, e.g. "
                f"Mesh(jax.devices(), ('data',))"
            )
        explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
        if explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ())):
            raise ValueError(
                f"mesh={mesh!r} has Explicit axes (jax.make_mesh's default in recent jax); "
                f"fuseloop shards the batch with automatic axes: build the mesh with "
                f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * "
                f"len(names)) or Mesh(jax.devices(), ('data',))"
            )
        self.n_shards = mesh.shape["data"]
        if jax.process_count() > 1:
            _check_spans_processes(mesh)
        # The batch a process feeds is its share: it divides over its own devices.
        self.n_local = self.n_shards // jax.process_count()
        self._state = NamedSharding(mesh, PartitionSpec())
        self._batch = NamedSharding(mesh, PartitionSpec("data"))
        self._chunk = NamedSharding(mesh, PartitionSpec(None, "data"))

    def put_state(self, tree: Any, made_here: bool = False) -> Any:
        """The step state (or metric tail) on the device; replicated over a mesh.
        `made_here`: a compiled program's output (on the device already, so on one device
        nothing is looked at)."""
        if self._state is None and made_here:
            return tree  # a program's output, on the device already
        if self._state is None and all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)):
            return on_one_device_set(tree)  # on the device: no Python-side device_put
        try:
            if self._state is not None and jax.process_count() > 1:
                return jax.tree.map(self._put_replicated, tree)
            return jax.device_put(tree, self._state)
        except TypeError as error:
            _refuse_non_arrays(tree, error)
            raise

    def _put_replicated(self, leaf: Any) -> Any:
        """One leaf replicated over a mesh of several processes: jax moves typed PRNG keys
        there only as their raw data, wrapped again once placed."""
        if holds_typed_keys(leaf):
            data = jax.device_put(raw_keys(leaf), self._state)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        return jax.device_put(leaf, self._state)

    @property
    def replicated(self) -> Any:
        """The sharding of data every device holds whole (None on one device)."""
        return self._state

    @property
    def dataset(self) -> Any:
        """Where a device-resident dataset lives: over a mesh, split along its example axis
        like a batch (each device holds its block of rows, each process only its devices'
        rows; `_shards.place_rows`); None on one device.
        """
        return self._batch

    def chunk_sharding(self, batch_size: int, short: bool = False) -> Any:
        """The sharding of a stacked chunk over the mesh (None on one device), after
        checking that `batch_size` (`short`: the dataset's short last batch's) divides over
        the mesh's "data" axis."""
        if self._chunk is None:
            return None
        require_divides(batch_size, self.n_shards, short)
        return self._chunk

    def indivisible(self, batch_size: int) -> int | None:
        """The devices of the mesh's "data" axis where a batch of `batch_size` examples
        does not divide over them; None where it does, or on one device."""
        if self._chunk is None or batch_size % self.n_shards == 0:
            return None
        return int(self.n_shards)

    def chunk_transfer(self) -> Any:
        """The context in which a fused dispatch may move its host chunk to the device
        (the one host-to-device transfer of a chunk; every other stays disallowed by a
        caller's transfer guard). Without a guard nothing needs allowing, and entering
        jax's context would cost the launch about 4 us."""
        if getattr(jax.config, _HOST_TO_DEVICE_GUARD, None) in (None, "allow"):
            return _NOTHING_TO_ALLOW
        return jax.transfer_guard_host_to_device("allow")

    def _check_divisible(self, tree: Any, axis: int, where: str) -> None:
        for leaf in jax.tree.leaves(tree):
            shape = getattr(leaf, "shape", ())
            if len(shape) > axis and shape[axis] % self.n_local != 0:
                raise ValueError(
                    f"mesh: {where} has batch size {shape[axis]}, which does not divide over "
                    f"the {self.n_shards} devices of the mesh's 'data' axis; use a batch size "
                    f"that is a multiple of {self.n_shards} (for a short last batch: one "
                    f"that leaves a multiple of {self.n_shards} last, or drop it, e.g. "
                    f"drop_remainder=True)"
                )

    def put_batch(self, batch: Any, iteration: int) -> Any:
        """One batch for an unfused step. On one device the host arrays go straight into
        the compiled call, whose C++ argument path moves them far faster than a separate
        `device_put` (the transfer is still counted)."""
        self.stats["h2d_transfers"] += 1
        if self._batch is None:
            return batch
        self._check_divisible(batch, 0, f"the batch at iteration {iteration}")
        return assemble_global(batch, self._batch)

    def put_chunk(self, stacked: Any, n_valid: int) -> Any:
        """`(stacked_chunk, n_valid)` ready for the fused program: one transfer.

        On one device the host arrays are handed to the compiled call itself, inside
        `chunk_transfer()`: the call's C++ argument path moves them in a fraction of a
        separate `device_put`'s time, and the transfer stays explicit and counted.
        """
        self.stats["h2d_transfers"] += 1
        if self._chunk is None or self._state is None:  # no mesh: both are None
            return stacked, self.count(n_valid)
        self._check_divisible(stacked, 1, "a fused chunk")
        return assemble_global(stacked, self._chunk), assemble_global(
            self.count(n_valid), self._state
        )

    def count(self, n: int) -> Any:
        """A dispatch's count of live slots: on one device the shared device scalar
        (`device_int`: no transfer per launch; a host scalar cost each launch about 3 us),
        over a mesh a host scalar, placed with the program's replicated inputs."""
        return device_int(n) if self._state is None else np.int32(n)


def _check_spans_processes(mesh: Mesh) -> None:
    """Under jax.distributed the mesh is one global mesh: over every process's devices,
    each process holding as many. A mesh of one process's devices would train a model of
    its own on each process (its share of each batch), silently."""
    held = np.zeros(jax.process_count(), int)
    for device in mesh.devices.flat:
        held[device.process_index] += 1
    if held.min() == 0 or held.min() != held.max():
        raise ValueError(
            f"mesh: under jax.distributed it must span every process's devices, each "
            f"process holding as many (here {', '.join(map(str, held))} devices for processes "
            f"0-{len(held) - 1}): build it over jax.devices(), e.g. Mesh(jax.devices(), "
            f"('data',)), not jax.local_devices(); or pass mesh=None, which is that global mesh"
        )


def require_divides(batch_size: int, devices: int, short: bool = False) -> None:
    """Refuses a batch of `batch_size` examples (`short`: the dataset's short last batch)
    that does not divide over the `devices` of a mesh's "data" axis.

    Example:
        >>> require_divides(32, 4)  # 8 examples on each device
    """
    if batch_size % devices == 0:
        return
    if not short:
        raise ValueError(
            f"mesh: the dataset's batch size {batch_size} does not divide over the "
            f"{devices} devices of the mesh's 'data' axis; use a batch size that is a "
            f"multiple of {devices}"
        )
    # Several processes always share one global mesh: mesh=None is that one.
    one_device = (
        ", or run without the mesh (mesh=None: one device takes a batch of any size, so an "
        "evaluation counts every example)"
        if jax.process_count() == 1
        else ""
    )
    d = devices
    raise ValueError(
        f"mesh: the dataset's short last batch (drop_remainder=False) holds {batch_size} "
        f"examples, which do not divide over the {d} devices of the mesh's 'data' axis. With "
        f"batches of a multiple of {d}, the last one divides over the devices only where the "
        f"dataset's size does: only a dataset of a multiple of {d} examples keeps them all on "
        f"this mesh. Trim the dataset to one (or pad it, with the padding weighed out of the "
        f"loss and metrics) or pass drop_remainder=True (the short batch is left out)"
        f"{one_device}"
    )


def _refuse_non_arrays(tree: Any, error: TypeError) -> None:
    """Raises a ValueError naming the step state's first leaf no device holds (a string,
    an object), with what to do; returns where none is found (`error` stands)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _device_holds(leaf):
            raise ValueError(
                f"step_state{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                f"({leaf!r:.60}), which no device holds: a step state holds arrays and "
                f"numbers only (the loop carries it on the device). Keep such values "
                f"outside it (in the step function's closure, or state.handler_metadata)"
                f"{_MODULE_FIX if callable(leaf) and _holds_equinox_module(tree) else ''}"
            ) from error


def _holds_equinox_module(tree: Any) -> bool:
    eqx = sys.modules.get("equinox")
    if eqx is None:  # never imported: no module of its can be here
        return False
    modules = jax.tree.leaves(tree, is_leaf=lambda node: isinstance(node, eqx.Module))
    return any(isinstance(node, eqx.Module) for node in modules)


# A function among an equinox module's leaves is most often its activation.
_MODULE_FIX = (
    "; a whole equinox module keeps its functions beside its arrays: carry "
    "`params, static = eqx.partition(model, eqx.is_array)`'s params and rebuild it in the "
    "step with eqx.combine(params, static)"
)


def _device_holds(leaf: Any) -> bool:
    if isinstance(leaf, jax.Array):
        return True
    try:
        return not held_by_no_device(np.asarray(leaf).dtype)
    except (TypeError, ValueError):
        return False
