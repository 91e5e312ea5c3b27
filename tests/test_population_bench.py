"""`fuseloop bench --population` runs and reports (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from fuseloop.bench import main
from fuseloop.bench._population import population_benchmark, population_markdown


def test_population_benchmark_reports_every_system():
    # The workload the CLI test below runs (`--members 2 --models mlp-demo`, 3 epochs), so
    # that it reads these programs from the compilation cache instead of compiling its own.
    report = population_benchmark(members=2, epochs=3, rounds=1, model="mlp-demo")
    systems = {"population", "population_run", "sequential", "floor"}
    assert set(report["median_s"]) == systems and set(report["median_cpu_s"]) == systems
    assert set(report["cpu_ratios"]) == {
        "sequential_over_population",
        "population_over_floor",
        "population_run_over_floor",
    }
    assert report["meta"]["params_agreement"] < 1e-4
    text = population_markdown(report)
    assert "sequential / population" in text and "population / floor" in text
    assert "wall:" in text and "CPU:" in text and "fuse='run'" in text


def test_cli_population_flag_writes_json(tmp_path, capsys):
    path = tmp_path / "pop.json"
    args = ["--population", "--members", "2", "--reps", "1", "--models", "mlp-demo"]
    assert main([*args, "--json", str(path)]) == 0
    assert "Populations: 2 members of mlp-demo" in capsys.readouterr().out
    meta = json.loads(path.read_text())["meta"]
    assert meta["members"] == 2 and meta["model"] == "mlp-demo"
    assert meta["command"] == "fuseloop bench " + " ".join([*args, "--json", str(path)])


def test_cli_population_names_the_models_it_knows(capsys):
    with pytest.raises(SystemExit) as exited:  # a usage error, as every other bad option
        main(["--population", "--models", "mlp-large"])
    assert exited.value.code == 2
    assert "mlp-tiny,mlp-demo" in capsys.readouterr().err
