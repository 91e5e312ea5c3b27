"""Smoke test of the benchmark machinery: tiny model, one repetition, no timing asserted.

The MLP benchmark runs `mlp-tiny` in the shape `fuseloop bench --quick --models mlp-tiny`
runs it (batch 32, 100 batches), as the doctests of `fuseloop.bench` do: their programs
are then read from the persistent compilation cache, not compiled again.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import jax
import numpy as np
import pytest

from fuseloop import bench
from fuseloop.bench import _guards, _harness, _output, _peers
from fuseloop.bench._systems import Sample, System
from fuseloop.bench._workload import MODELS, Workload

TINY = MODELS["mlp-tiny"]
JAX_SYSTEMS = (
    "floor",
    "floor_transfer",
    "fl_fuse32",
    "fl_fuseauto",
    "fl_unfused",
    "plain",
    "io_callback",
)


@pytest.fixture(scope="module")
def report() -> dict:
    return bench.run_benchmark(
        [TINY],  # a ModelSpec, not its name (the doctests pass names)
        reps=1,
        quick=True,
        peers=False,
        sweep_model=TINY.name,
        sweep_ks=(1, 4),
        compile_ks=(2, 4),
        overlap_model=TINY.name,
    )


def test_json_has_every_section(report: dict, tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "bench.json"
    _output.write_json(report, str(path))
    loaded = json.loads(path.read_text())
    assert {
        "meta",
        "models",
        "ratio_definitions",
        "targets",
        "sweep",
        "compile_vs_k",
        "overlap",
    } <= set(loaded)
    machine = loaded["meta"]["machine"]
    assert machine["cpu_count"] >= 1 and machine["platform"] and machine["jax_devices"]
    assert loaded["meta"]["machine"]["versions"]["jax"] == jax.__version__
    assert loaded["meta"]["batch_size"] == 32 and loaded["meta"]["batches_per_epoch"] == 100
    tiny = loaded["models"]["mlp-tiny"]
    assert tiny["params"] == 24 * 32 + 32 + 32 * 10 + 10
    assert set(JAX_SYSTEMS) <= set(tiny["systems"])
    assert set(tiny["ratios"]) == {r[0] for r in _harness.RATIOS}
    assert [row["K"] for row in loaded["sweep"]["rows"]] == [1, 4]
    assert [row["K"] for row in loaded["compile_vs_k"]] == [2, 4]
    overlap = loaded["overlap"]
    assert overlap["status"] == "ok", overlap["reason"]
    assert overlap["data_s"] > 0 and overlap["fused_s"] > 0


def test_jax_systems_pass_their_guards(report: dict) -> None:
    systems = report["models"]["mlp-tiny"]["systems"]
    for key in JAX_SYSTEMS:
        assert systems[key]["status"] == "ok", (key, systems[key]["reason"])
        epochs = report["models"]["mlp-tiny"]["epochs_per_sample"]
        # One sample of `epochs` epochs (reps=1): a fuseloop sample is one data point, the
        # mean of its epochs (the next epoch's first chunk launches ahead of the read).
        points = 1 if key.startswith("fl_") else epochs
        assert len(systems[key]["samples_us"]) == points and systems[key]["median_us"] > 0
    assert systems["fl_fuse32"]["info"]["bitwise_equal_to_unfused"] is True
    assert systems["floor"]["info"]["max_abs_diff_vs_fuseloop"] <= 1e-4


def test_markdown_and_plot(report: dict, tmp_path) -> None:  # noqa: ANN001
    text = _output.markdown(report)
    assert "| system | mlp-tiny (1,130 params) |" in text and "Chunk-size sweep" in text
    assert "fuseloop fuse=32" in text
    if importlib.util.find_spec("matplotlib") is not None:
        path = tmp_path / "bench.png"
        assert _output.write_plot(report, str(path)) is None
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_report_names_the_cpu_dispatch_it_ran_under(report: dict) -> None:
    # JAX_CPU_ENABLE_ASYNC_DISPATCH=false (read when the backend starts) runs programs on
    # the calling thread where it can, which changes the figures; the report says which.
    mode = "async" if jax.config.read("jax_cpu_enable_async_dispatch") else "inline"
    assert report["meta"]["machine"]["cpu_dispatch"] == mode
    assert f"JAX on cpu ({mode} dispatch)." in _output.markdown(report).splitlines()[0]
    for backend, dispatch, shown in (
        ("cpu", "inline", "JAX on cpu (inline dispatch)."),
        ("gpu", "async", "JAX on gpu."),  # the setting is the CPU backend's alone
    ):
        machine = {**report["meta"]["machine"], "jax_backend": backend, "cpu_dispatch": dispatch}
        other = {**report, "meta": {**report["meta"], "machine": machine}}
        assert shown in _output.markdown(other).splitlines()[0]


# ----------------------------------------------------------------- guards
class FakeSystem(System):
    """A system whose sample is whatever the test says."""

    def __init__(self, workload: Workload, sample: Sample):
        super().__init__(workload)
        self._sample = sample

    def setup(self) -> None:
        pass

    def sample(self, epochs: int) -> Sample:
        return self._sample


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload(TINY, batch_size=32, n_batches=100)  # the report's (its params too)


def _measure(workload: Workload, **samples: Sample) -> dict:
    plan = [(key, key, lambda s=s: FakeSystem(workload, s)) for key, s in samples.items()]
    results, params, references = _harness.measure(plan, reps=2, iterations=2)
    _harness.cross_check(results, params, {"fl_unfused": _params(workload)})
    return results


def _params(workload: Workload, delta: float = 0.0) -> dict:
    return jax.tree.map(lambda a: a + np.float32(delta), workload.params)


def test_guards_refuse_nan_and_the_wrong_device(workload: Workload) -> None:
    device = str(jax.devices()[0])
    results = _measure(
        workload,
        nan=Sample([0.01], {device}, outputs=np.array([1.0, np.nan])),
        elsewhere=Sample([0.01], {"some_other_device:7"}, outputs=np.ones(2)),
        nowhere=Sample([0.01], set(), outputs=np.ones(2)),
        fine=Sample([0.01], {device}, outputs=np.ones(2)),
    )
    assert results["nan"].status == "refused" and "NaN" in results["nan"].reason
    assert results["elsewhere"].status == "refused"
    assert "intended device" in results["elsewhere"].reason
    assert results["nowhere"].status == "refused"
    assert results["fine"].ok and results["fine"].median_us == pytest.approx(5000.0)


def test_guards_refuse_fused_results_that_differ_from_unfused(workload: Workload) -> None:
    device = str(jax.devices()[0])
    tiny = np.finfo(np.float32).eps
    results = _measure(
        workload,
        fl_unfused=Sample([0.01], {device}, np.ones(1), _params(workload)),
        fl_fuse32=Sample([0.01], {device}, np.ones(1), _params(workload, tiny)),
        fl_fuse4=Sample([0.01], {device}, np.ones(1), _params(workload)),
        floor=Sample([0.01], {device}, np.ones(1), _params(workload, 0.5)),
        plain=Sample([0.01], {device}, np.ones(1), _params(workload, 1e-6)),
    )
    assert results["fl_fuse32"].status == "refused" and "bitwise" in results["fl_fuse32"].reason
    assert results["fl_fuse4"].ok
    assert results["floor"].status == "refused" and "same training" in results["floor"].reason
    assert results["plain"].ok


def test_fused_results_are_refused_without_an_unfused_reference(workload: Workload) -> None:
    device = str(jax.devices()[0])
    results = _measure(
        workload,
        fl_unfused=Sample([0.01], {device}, np.array([np.inf]), _params(workload)),
        fl_fuse32=Sample([0.01], {device}, np.ones(1), _params(workload)),
    )
    assert results["fl_unfused"].status == "refused"
    assert results["fl_fuse32"].status == "refused"
    assert "fuse=False" in results["fl_fuse32"].reason


def test_bitwise_check_sees_one_ulp() -> None:
    a = {"w": np.float32([1.0, 2.0])}
    b = {"w": np.nextafter(a["w"], np.float32(3.0))}
    _guards.check_bitwise(a, a, "same")
    with pytest.raises(_guards.Refused, match="bitwise"):
        _guards.check_bitwise(a, b, "one ulp")


# ----------------------------------------------------------------- peers
def test_missing_peers_are_reported_as_skipped(
    workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("keras", "torch") else real(name, *a),
    )
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    plan = [
        ("keras_spe32", "Keras", lambda: _peers.KerasFit(workload, 32)),
        ("torch", "PyTorch", lambda: _peers.TorchEager(workload)),
    ]
    results, _, _ = _harness.measure(plan, reps=1, iterations=2)
    for key in ("keras_spe32", "torch"):
        assert results[key].status == "skipped"
        assert "not installed" in results[key].reason
        assert results[key].to_json()["median_us"] is None
    report = {
        "meta": {
            "reps": 1,
            "quick": True,
            "batch_size": 4,
            "batches_per_epoch": 2,
            "machine": {"cpus_usable": 2, "jax_backend": "cpu"},
        },
        "models": {
            "micro": {
                "params": 67,
                "ratios": {},
                "systems": {k: r.to_json() for k, r in results.items()},
            }
        },
        "ratio_definitions": [],
        "targets": [],
    }
    assert "skipped: keras not installed" in _output.markdown(report)


def test_cli_rejects_an_unknown_model() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--models", "mlp-huge"])


# ----------------------------------------------------------------- model zoo
@pytest.fixture(scope="module")
def zoo_report() -> dict:
    pytest.importorskip("sklearn", reason="the zoo's cnn trains on scikit-learn's digits")
    return bench.run_benchmark(["cnn"], reps=1, quick=True, batch_size=8, n_batches=2, peers=False)


def test_zoo_cnn_passes_its_guards_with_batch_stats(zoo_report: dict) -> None:
    cnn = zoo_report["models"]["cnn"]
    systems = cnn["systems"]
    expected = {"floor", "floor_transfer", "fl_fuse32", "fl_fuse32_resident", "fl_unfused", "plain"}
    assert set(systems) == expected
    for key in expected:
        assert systems[key]["status"] == "ok", (key, systems[key]["reason"])
    assert systems["fl_fuse32"]["info"]["bitwise_equal_to_unfused"] is True
    assert systems["fl_fuse32_resident"]["info"]["bitwise_equal_to_unfused"] is True
    assert systems["fl_fuse32_resident"]["info"]["h2d_transfers_per_epoch"] == [0.0]
    assert systems["floor"]["info"]["max_abs_diff_vs_fuseloop"] <= 1e-4
    assert cnn["data"] == "sklearn digits" and cnn["params"] > 1000
    for stat in ("median", "min"):
        zoo = cnn["zoo"][stat]
        assert zoo["floor_us"] > 0
        assert zoo["overhead_us"] == zoo["unfused_us"] - zoo["floor_us"]
        assert zoo["fused_vs_floor"] == zoo["fused_us"] / zoo["floor_us"]
    assert cnn["zoo"]["verdict"].split(":")[0] in (
        "compute-bound",
        "overhead-bound",
        "loop-penalized",
        "loop-favoured",
    )
    text = _output.markdown(zoo_report)
    assert "Model zoo: where fusion helps" in text and "| cnn | sklearn digits |" in text


def test_zoo_guards_compare_batch_stats() -> None:
    from fuseloop.bench._zoo import ZOO, ZooWorkload

    pytest.importorskip("sklearn", reason="the zoo's cnn trains on scikit-learn's digits")

    w = ZooWorkload(ZOO["cnn"], batch_size=8, n_batches=2)  # zoo_report's shapes
    variables = w.compared(w.variables)
    assert set(variables) == {"params", "batch_stats"}
    changed = jax.tree.map(lambda a: a, variables)
    changed["batch_stats"] = jax.tree.map(lambda a: a + 1.0, changed["batch_stats"])
    with pytest.raises(_guards.Refused, match="bitwise"):
        _guards.check_bitwise(changed, variables, "batch_stats")


@pytest.fixture(scope="module")
def char_workloads() -> dict:
    from fuseloop.bench._zoo import ZOO, ZooWorkload

    return {
        name: ZooWorkload(ZOO[name], batch_size=4, n_batches=2) for name in ("transformer", "gru")
    }


def test_zoo_char_data_is_next_character_prediction_on_an_installed_text(
    char_workloads: dict,
) -> None:
    from fuseloop.bench._zoo import SEQUENCE, char_corpus

    text, source = char_corpus()
    assert len(text) > 1000 and source.startswith(("jax", "flax", "optax", "numpy"))
    w = char_workloads["transformer"]
    assert w.x.shape == w.y.shape == (8, SEQUENCE) and w.x.dtype == np.int32
    np.testing.assert_array_equal(w.x[:, 1:], w.y[:, :-1])
    assert w.x.min() >= 0 and w.x.max() < w.vocab == len(set(text))
    logits = jax.eval_shape(lambda v, x: w.module.apply(v, x), w.variables, w.batches[0][0])
    assert logits.shape == (4, SEQUENCE, w.vocab)


def test_zoo_gru_step_is_fuseloops_trainer_step(char_workloads: dict) -> None:
    import fuseloop as fl

    w = char_workloads["gru"]
    state = fl.trainer(w.module, "sparse_categorical_cross_entropy", w.tx).run(
        w.batches, w.variables, fuse=False
    )
    variables, opt_state = w.fresh_state()
    step = jax.jit(w.train_step)
    losses = []
    for x, y in w.batches:
        variables, opt_state, loss = step(variables, opt_state, x, y)
        losses.append(float(loss))
    assert (
        _guards.check_close(
            jax.device_get(variables),
            jax.device_get(w.compared(state.step_state["params"])),
            "gru step",
        )
        <= 1e-5
    )
    assert state.history[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_cli_selects_the_zoo() -> None:
    assert bench.select_models("cnn,gru", zoo=False) == ["cnn", "gru"]
    assert bench.select_models("gru", zoo=True) == ["gru", "cnn", "transformer"]
    assert bench.select_models(None, zoo=True) == ["cnn", "transformer", "gru"]
    with pytest.raises(ValueError, match="transformer"):
        bench.run_benchmark(["resnet"], reps=1)


@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="keras not installed")
def test_zoo_keras_models_have_the_same_shapes(char_workloads: dict) -> None:
    from fuseloop.bench._zoo import ZOO, ZooWorkload

    try:
        keras = _peers.import_keras()
    except _guards.Skipped as why:
        pytest.skip(str(why))
    for name in ZOO:
        if name == "cnn" and importlib.util.find_spec("sklearn") is None:
            continue
        w = char_workloads.get(name) or ZooWorkload(ZOO[name], batch_size=4, n_batches=1)
        model = w.keras_model(keras)
        out = jax.eval_shape(w.module.apply, w.variables, w.batches[0][0])
        assert tuple(model.output_shape[1:]) == out.shape[1:], name
        if name != "cnn":  # Keras' GRU gate layout differs; the CNN has BN's moving stats
            continue
        trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
        assert trainable == w.n_params
