"""Data parallelism over a `jax.sharding.Mesh` with a "data" axis (issue 6 item 5).

The checks run in one subprocess started with 4 virtual CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`), since the device count is fixed
when jax starts. The script prints one JSON line of findings that the tests assert on.
"""

from __future__ import annotations

import textwrap

import pytest

from conftest import run_on_four_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import fuseloop as fl

    assert len(jax.devices()) == 4, jax.devices()
    out = {}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int32)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]
    loop = fl.trainer(fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy",
                      optax.adam(1e-2)).metric("accuracy")
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def leaves(state):
        return [np.asarray(a) for a in jax.tree.leaves(state.step_state)]

    def gap(a, b):
        worst = 0.0
        for u, v in zip(leaves(a), leaves(b), strict=True):
            scale = np.maximum(np.abs(v).astype(np.float64), 1e-3)
            worst = max(worst, float(np.max(np.abs(u - v) / scale)))
        return worst

    def history_gap(a, b):
        return max(abs(a.history[e][k] - b.history[e][k]) / max(abs(b.history[e][k]), 1e-3)
                   for e in b.history for k in b.history[e])

    def sharding_of(state):
        return [str(getattr(a, "sharding", None)) for a in jax.tree.leaves(state.step_state)]

    data_kinds = {
        "list": lambda: batches,
        "arrays": lambda: fl.data.arrays(x, y, 8, seed=1),
        "resident": lambda: fl.data.arrays(x, y, 8, seed=1, device=True),
    }
    for kind, make in data_kinds.items():
        single = loop.run(make(), epochs=2)
        for fuse in (False, 4):
            name = f"{kind}-{fuse}"
            try:
                sharded = loop.run(make(), epochs=2, fuse=fuse, mesh=mesh)
            except Exception as error:
                out[name] = {"error": f"{type(error).__name__}: {error}"}
                continue
            out[name] = {
                "param_gap": gap(sharded, single),
                "history_gap": history_gap(sharded, single),
                "steps": int(sharded.step_state["step"]),
                "replicated": all(
                    getattr(a, "sharding", None) is not None
                    and a.sharding.is_fully_replicated
                    for a in jax.tree.leaves(sharded.step_state)),
            }

    for fuse in (False, 4):
        odd = [(x[i:i + 6], y[i:i + 6]) for i in range(0, 36, 6)]
        try:
            loop.run(odd, fuse=fuse, mesh=mesh)
            out[f"odd-{fuse}"] = "no error"
        except ValueError as error:
            out[f"odd-{fuse}"] = str(error)

    # 42 examples in batches of 8 on the device: the short last batch (2) does not divide.
    short_last = fl.data.arrays(x[:42], y[:42], 8, drop_remainder=False, device=True)
    try:
        loop.run(short_last, fuse=4, mesh=mesh)
        out["short-last"] = "no error"
    except ValueError as error:
        out["short-last"] = str(error)
    # The same from the host, unfused: refused before a step too, not at the last batch.
    try:
        loop.run(fl.data.arrays(x[:42], y[:42], 8, drop_remainder=False), mesh=mesh)
        out["short-last-host"] = "no error"
    except ValueError as error:
        counts = error.fuseloop_state.event_counts["iteration_completed"]
        out["short-last-host"] = [str(error), counts.get("total", 0)]

    # Fused from the host: the fused run's refusal names only fixes that work on the mesh.
    try:
        loop.run(fl.data.arrays(x[:42], y[:42], 8, drop_remainder=False), fuse=4, mesh=mesh)
        out["short-last-host-fused"] = "no error"
    except ValueError as error:
        out["short-last-host-fused"] = [type(error).__name__, str(error)]

    # A mesh run's params (committed to every device) with a new head put on one device,
    # or on the mesh's devices in another order: every entry point takes the tree as it
    # takes the same values from the host.
    trained = loop.run(batches, mesh=mesh).params["params"]
    head = loop.run(batches[:1]).params["params"]["Dense_1"]
    reversed_mesh = Mesh(np.array(jax.devices()[::-1]), ("data",))
    placed = {
        "one": jax.device_put(head, jax.devices()[1]),
        "reordered": jax.device_put(head, NamedSharding(reversed_mesh, PartitionSpec())),
    }
    evaluator = fl.evaluator(fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy")

    def same_params(a, b):
        return all(np.array_equal(u, v) for u, v in
                   zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True))

    def swapping(new_head):
        def swap(state):
            if state.epoch == 0:
                params = {"params": {**state.params["params"], "Dense_1": new_head}}
                return "continue", state.replace(step_state={**state.step_state, "params": params})
        return loop.handle_event("epoch_completed", swap)

    def mixed_cases(mixed, host):
        return {
            "train": lambda m: same_params(loop.run(batches, mixed, fuse=4, mesh=m),
                                           loop.run(batches, host, fuse=4, mesh=m)),
            "evaluate": lambda m: evaluator.run(batches, mixed, mesh=m).metrics
            == evaluator.run(batches, host, mesh=m).metrics,
            "handler": lambda m: same_params(
                swapping(mixed["params"]["Dense_1"]).run(batches, epochs=2, mesh=m),
                swapping(host["params"]["Dense_1"]).run(batches, epochs=2, mesh=m)),
            "predict": lambda m: np.array_equal(fl.predict(loop.program.model, mixed, x),
                                                fl.predict(loop.program.model, host, x)),
            "population": lambda m: same_params(
                loop.run(batches, mixed, population={"seed": [0, 0]}),
                loop.run(batches, host, population={"seed": [0, 0]})),
        }

    for how, new_head in placed.items():
        mixed = {"params": {**trained, "Dense_1": new_head}}
        host = jax.tree.map(np.asarray, mixed)
        for case, check in mixed_cases(mixed, host).items():
            # predict and a population take no mesh: they run once.
            places = (("one-device", None),) if case in ("predict", "population") else (
                ("mesh", mesh), ("one-device", None))
            for where, m in places:
                try:
                    out[f"mixed-{how}-{case}-{where}"] = bool(check(m))
                except Exception as error:
                    out[f"mixed-{how}-{case}-{where}"] = f"{type(error).__name__}: {error}"

    # Inside the compiled step, the batch is split over the "data" axis.
    seen = []

    def inspecting_step(batch, state):
        jax.debug.inspect_array_sharding(batch[0], callback=seen.append)
        return {"total": state["total"] + batch[0].sum()}

    for fuse in (False, 4):
        seen.clear()
        summed = fl.loop(inspecting_step).run(batches, {"total": np.float32(0)}, fuse=fuse,
                                              mesh=mesh)
        out[f"batch-sharding-{fuse}"] = {
            "sharded": bool(seen) and all(not s.is_fully_replicated for s in seen),
            "specs": [str(getattr(s, "spec", s)) for s in seen],
            "total_gap": abs(float(summed.step_state["total"]) - float(x.sum())),
        }

    # A per-batch scalar beside the examples (a temperature): replicated, not split.
    def scaled_step(batch, state):
        return {"total": state["total"] + (batch[0] * batch[1]).sum()}

    scaled = [(b[0], np.float32(0.5 + i)) for i, b in enumerate(batches)]
    for fuse in (False, 4):
        try:
            totals = [
                float(fl.loop(scaled_step).run(scaled, {"total": np.float32(0)}, fuse=fuse,
                                               mesh=m).step_state["total"])
                for m in (mesh, None)
            ]
            out[f"scalar-leaf-{fuse}"] = abs(totals[0] - totals[1]) / abs(totals[1])
        except Exception as error:
            out[f"scalar-leaf-{fuse}"] = f"{type(error).__name__}: {error}"

    try:
        loop.run(batches, mesh=Mesh(np.array(jax.devices()), ("model",)))
        out["no-data-axis"] = "no error"
    except ValueError as error:
        out["no-data-axis"] = str(error)
    explicit = getattr(jax.sharding, "AxisType", None)
    if explicit is not None:
        try:
            loop.run(batches, mesh=jax.make_mesh((4,), ("data",),
                                                 axis_types=(explicit.Explicit,)))
            out["explicit-axes"] = "no error"
        except ValueError as error:
            out["explicit-axes"] = str(error)
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def findings() -> dict:
    return run_on_four_devices(SCRIPT)


@pytest.mark.parametrize("kind", ["list", "arrays"])
@pytest.mark.parametrize("fuse", [False, 4])
def test_mesh_run_matches_a_single_device_run(findings, kind, fuse):
    result = findings[f"{kind}-{fuse}"]
    assert "error" not in result, result.get("error")
    _assert_matches(result)


@pytest.mark.parametrize("fuse", [False, 4])
def test_device_resident_data_on_a_mesh_matches_a_single_device_run(findings, fuse):
    """The dataset is split over the devices and each gathered chunk sharded along its batch
    axis (tests/test_resident_sharding.py checks the storage)."""
    result = findings[f"resident-{fuse}"]
    assert "error" not in result, result.get("error")
    _assert_matches(result)


def _assert_matches(result: dict) -> None:
    assert result["steps"] == 16
    assert result["param_gap"] < 1e-5 and result["history_gap"] < 1e-5, result
    assert result["replicated"]  # params and optimizer state replicated over the mesh


@pytest.mark.parametrize("fuse", [False, 4])
def test_the_batch_axis_is_sharded_inside_the_step(findings, fuse):
    result = findings[f"batch-sharding-{fuse}"]
    assert result["sharded"] and all("data" in spec for spec in result["specs"]), result
    assert result["total_gap"] < 1e-3  # every example still seen once


@pytest.mark.parametrize("fuse", [False, 4])
def test_batch_that_does_not_divide_over_the_mesh_is_a_clear_error(findings, fuse):
    message = findings[f"odd-{fuse}"]
    assert message != "no error"
    assert "mesh" in message and "6" in message and "4" in message


def test_a_short_last_batch_that_does_not_divide_is_named_as_the_short_batch(findings):
    message = findings["short-last"]
    assert "short last batch (drop_remainder=False) holds 2 examples" in message, message
    assert "batch size 2" not in message  # the user's batch size is 8
    # No batch size keeps every example of a dataset that is not a multiple of the devices:
    # the message says so, and names the ways that do (pad or trim, no mesh).
    assert "only a dataset of a multiple of 4" in message and "mesh=None" in message, message
    # Host-fed, the run trained the whole epoch, then advised the batch size it had.
    message, steps = findings["short-last-host"]
    assert "short last batch (drop_remainder=False) holds 2 examples" in message, message
    assert steps == 0


def test_a_fused_host_runs_short_batch_refusal_names_fixes_that_work_on_the_mesh(findings):
    """A fused run over host data with a short last batch is told to use device=True or
    fuse=False; on a mesh that the short batch does not divide over, both fail next, so
    the refusal says so and names what makes them work (a trimmed dataset, or no mesh)."""
    kind, message = findings["short-last-host-fused"]
    assert kind == "FusionError", (kind, message)
    assert "divide over the 4 devices" in message and "drop_remainder=True" in message
    assert "Trim the dataset to a multiple of 4 examples, or run without the mesh" in message
    assert "device=True" in message and "fuse=False" in message, message


_MIXED = [
    (how, case, where)
    for how in ("one", "reordered")
    for case in ("train", "evaluate", "handler", "predict", "population")
    for where in (("one-device",) if case in ("predict", "population") else ("mesh", "one-device"))
]


@pytest.mark.parametrize(("how", "case", "where"), _MIXED)
def test_variables_committed_to_different_devices_are_taken_as_from_the_host(
    findings, how, case, where
):
    """A mesh run's params with a new layer put on one device, or on the same devices in
    another order: jit refuses such arrays together, and its message named fuseloop's
    internal programs."""
    got = findings[f"mixed-{how}-{case}-{where}"]
    assert got is True, got


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_per_batch_scalar_is_replicated_over_the_mesh(findings, fuse):
    # It was put with the batch axis's sharding, and JAX refused a rank-0 value.
    assert findings[f"scalar-leaf-{fuse}"] < 1e-6


def test_mesh_without_a_data_axis_is_rejected(findings):
    message = findings["no-data-axis"]
    assert message != "no error" and "data" in message and "mesh" in message


def test_a_mesh_with_explicit_axes_is_refused_naming_the_auto_axes(findings):
    if "explicit-axes" not in findings:
        pytest.skip("this jax has no explicit mesh axes")
    message = findings["explicit-axes"]
    assert "Explicit axes" in message and "AxisType.Auto" in message, message
