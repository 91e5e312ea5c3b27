"""`fuseloop bench --population` runs and reports (no timing assertions)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from fuseloop.bench import main

ARGS = ["--population", "--members", "2", "--reps", "1", "--models", "mlp-demo"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One `fuseloop bench --population` run (2 members of mlp-demo, 3 epochs, 1 round),
    read by the tests below: its arguments, exit code, printed markdown and JSON report."""
    path = tmp_path_factory.mktemp("bench") / "pop.json"
    args = [*ARGS, "--json", str(path)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return args, code, out.getvalue(), json.loads(path.read_text())


def test_population_benchmark_reports_every_system(cli_run):
    # population_benchmark's report as the CLI writes it, and population_markdown's table
    # as it prints it.
    _, _, text, report = cli_run
    systems = {"population", "population_run", "sequential", "floor"}
    assert set(report["median_s"]) == systems and set(report["median_cpu_s"]) == systems
    assert set(report["cpu_ratios"]) == {
        "sequential_over_population",
        "population_over_floor",
        "population_run_over_floor",
    }
    assert report["meta"]["params_agreement"] < 1e-4
    assert "sequential / population" in text and "population / floor" in text
    assert "wall:" in text and "CPU:" in text and "fuse='run'" in text


def test_cli_population_flag_writes_json(cli_run):
    args, code, text, report = cli_run
    assert code == 0
    assert "Populations: 2 members of mlp-demo" in text
    meta = report["meta"]
    assert meta["members"] == 2 and meta["model"] == "mlp-demo"
    assert meta["command"] == "fuseloop bench " + " ".join(args)


def test_cli_population_names_the_models_it_knows(capsys):
    with pytest.raises(SystemExit) as exited:  # a usage error, as every other bad option
        main(["--population", "--models", "mlp-large"])
    assert exited.value.code == 2
    assert "mlp-tiny,mlp-demo" in capsys.readouterr().err
