"""The scripts under bench/ that reach into fuseloop's private modules still run.

`fuseloop bench` and `bench/engine_costs.py` use the public API, which the rest of the suite
holds still; these scripts measure the engine against its own parts (programs, spares,
packing, the convolution layout), so a change inside the engine can break them without any
other test noticing. Each runs here once, in this process, with its smallest settings; the
numbers it prints are not checked (timing belongs to the benchmarks), what it prints is.
`bench/conv_layout.py` is left out: its one round compiles a CNN under XLA's own layout,
10-15 s on two cores, and `test_conv_layout.py` covers the lowering it calls.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

# script, its smallest settings, lines its report must print
SCRIPTS = {
    "fixed_cost_floor": (["--rounds", "1"], ["run1 - steady:", "least - steady:"]),
    "spares": (["--rounds", "1"], ["taking the spares saves"]),
    "carry_copy": (["--rounds", "1"], ["handler ratio, copy:", "handler ratio, pack:"]),
    "packed_carry": (["--rounds", "1"], ["packed saves per epoch:", "bitwise: True"]),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_bench_script_that_uses_private_modules_runs(name, monkeypatch, capsys):
    args, expected = SCRIPTS[name]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import engine_costs beside them
    runpy.run_path(str(BENCH / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    for line in expected:
        assert line in out, f"bench/{name}.py printed no {line!r}:\n{out}"


def test_the_suite_compiles_plugin_charges_each_compile_to_its_test(
    pytester, monkeypatch, tmp_path
):
    # bench/suite_compiles.py, loaded into a pytest run of one test that compiles a program.
    if "suite_compiles" in sys.modules:  # this session loaded it: the inner run shares its tallies
        pytest.skip("the outer session runs bench/suite_compiles.py itself")
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("FUSELOOP_SUITE_COMPILES_DIR", str(tmp_path))
    pytester.makepyfile(
        test_one="""
        import jax
        import jax.numpy as jnp

        def test_compiles_a_program():
            assert float(jax.jit(lambda x: x * 2 + 1)(jnp.float32(3))) == 7.0
        """
    )
    result = pytester.runpytest_inprocess("-p", "suite_compiles", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "where the suite's JAX time went" in out
    assert "jit(<lambda>)" in out
    assert "test_one.py::test_compiles_a_program" in out
