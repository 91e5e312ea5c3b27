"""What a carry packed into one buffer per dtype would save a run's launches (an experiment
for docs/design.md §6, "What a launch costs per buffer"; the engine does not do this yet).

mlp-tiny, one epoch of 100 batches in chunks of 32, the chunks already on the device (so
only the launches and the device loop differ). Two ways to run the engine's own device
loop (`Programs._device_loop`, the body every chunk program runs):

  * tree: as the engine does, the step state and accumulators passed as their 17 leaves;
  * packed: the same body inside a program that takes and returns the carry packed
    (`packing.pack_leaves`, one buffer per dtype), so a launch passes a few buffers; the
    step state is unpacked to its tree by one more program, launched right after the last
    chunk (a run must hand back a tree).

Each round runs both, in alternating order, right after the same device work (so each
starts cold, as a run does). The report gives the host's time in the first launch and in
the later ones, the wall time of the epoch to its final read and ready step state, and
checks that both end on the same bits.

Run: PYTHONPATH=src python bench/packed_carry.py [--rounds 300]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
from engine_costs import mlp_tiny, rounds_from_argv, tiny_trainer

from fuseloop._fusion import stack_chunk
from fuseloop._placement import device_int
from fuseloop.engine.packing import pack_leaves, unpacker
from fuseloop.engine.programs import Programs

K = 32


def _programs(loop: Any, carry: Any) -> tuple[Any, Any, Any, Any]:
    """`(tree chunk, packed chunk, pack, unpack)` programs over the engine's device loop."""
    programs = Programs(loop)
    body = programs._device_loop()
    leaves, treedef = jax.tree.flatten(carry)
    spec = tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in leaves)
    unpack = unpacker(treedef, spec)

    def packed_chunk(packed: Any, chunk: Any, n: Any) -> tuple[Any, ...]:
        state, tail, records, n_run = body(*unpack(packed), chunk, n)
        return pack_leaves((state, tail)), records, n_run

    return (
        programs.chunk(),
        jax.jit(packed_chunk, donate_argnums=0),
        jax.jit(pack_leaves),
        jax.jit(unpack),
    )


def main() -> None:
    rounds = rounds_from_argv(300)
    model, variables, batches = mlp_tiny()
    loop = tiny_trainer(model)
    start = loop.run(batches[:1], variables).step_state  # compiles the init, a real state
    tail = Programs(loop).fresh_tail()
    tree_chunk, packed_chunk, pack, unpack = _programs(loop, (start, tail))
    chunks = [
        (jax.device_put(stack_chunk(batches[i : i + K], K, i)), device_int(len(batches[i : i + K])))
        for i in range(0, len(batches), K)
    ]
    copy = jax.jit(lambda tree: jax.tree.map(lambda a: a + 0, tree))
    busy = jax.jit(lambda c: jax.lax.fori_loop(0, 60, lambda _, x: x @ x.T / 64.0, c))
    work = jax.numpy.ones((64, 64))

    def tree_epoch(carry: Any) -> tuple[list[float], Any]:
        state, tail = carry
        launches = []
        for chunk, n in chunks:
            began = time.perf_counter()
            state, tail, _, _ = tree_chunk(state, tail, chunk, n)
            launches.append(time.perf_counter() - began)
        np.asarray(tail["acc"]["loss"]["sum"])  # the final read
        return launches, jax.block_until_ready(state)

    def packed_epoch(carry: Any) -> tuple[list[float], Any]:
        packed = pack(carry)
        launches = []
        for chunk, n in chunks:
            began = time.perf_counter()
            packed, _, _ = packed_chunk(packed, chunk, n)
            launches.append(time.perf_counter() - began)
        state, _ = unpack(packed)  # launched right behind the last chunk
        np.asarray(packed[0][0])  # the final read: the float buffer holds the sums
        return launches, jax.block_until_ready(state)

    got: dict[str, dict[str, list[float]]] = {
        name: {"first": [], "later": [], "wall": []} for name in ("tree", "packed")
    }
    ends = {}
    epochs = {"tree": tree_epoch, "packed": packed_epoch}
    for epoch in epochs.values():
        epoch(copy((start, tail)))  # compile
    for r in range(rounds):
        for name in ("tree", "packed") if r % 2 else ("packed", "tree"):
            carry = jax.block_until_ready(copy((start, tail)))
            busy(work).block_until_ready()  # the host waits for the device, as before a run
            began = time.perf_counter()
            launches, ends[name] = epochs[name](carry)
            got[name]["wall"].append(time.perf_counter() - began)
            got[name]["first"].append(launches[0])
            got[name]["later"].append(statistics.median(launches[1:]))
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(ends["tree"]), jax.tree.leaves(ends["packed"]), strict=True)
    )
    for name, values in got.items():
        us = {k: statistics.median(v) * 1e6 for k, v in values.items()}
        print(
            f"{name:7s} first launch {us['first']:6.1f} us, later {us['later']:6.1f} us, "
            f"epoch to its ready state {us['wall']:7.1f} us"
        )
    paired = [t - p for t, p in zip(got["tree"]["wall"], got["packed"]["wall"], strict=True)]
    print(f"packed saves per epoch: {statistics.median(paired) * 1e6:.1f} us (paired per round)")
    print(f"same final step state, bitwise: {same}")


if __name__ == "__main__":
    main()
