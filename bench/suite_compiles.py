"""Where the test suite's time goes in JAX: compiles, cache reads, lowering and tracing.

A pytest plugin, opt-in (it is not loaded by the suite itself):

    PYTHONPATH=bench python -m pytest -q -p suite_compiles

It listens to jax.monitoring's compile events in every test process (pytest-xdist workers
included), charges each to the test that ran it, and prints at the end of the session:
the totals (XLA compiles that missed the persistent cache, cache reads, lowerings, traces),
the compiled programs by name, and the test files and tests that compiled the most.
Programs compiled in a test's subprocesses are not seen. Numbers are wall seconds of the
calls, so on a loaded machine they grow with the load; the counts do not.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.monitoring
import pytest

_DIR_VAR = "FUSELOOP_SUITE_COMPILES_DIR"
_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
}

_made_here: list[str] = []  # the directory this process made, removed after the summary
_current = ["(outside any test)"]
_per_test: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_per_program: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def _on_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _per_test[_current[0]]["cache_hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _per_test[_current[0]]["cache_misses"] += 1


def _on_duration(event: str, seconds: float, **kwargs: Any) -> None:
    name = _EVENTS.get(event)
    if name is None:
        return
    _per_test[_current[0]][name] += seconds
    if name == "compile_s":  # a miss compiles; a hit reads the executable inside this call
        program = _per_program[str(kwargs.get("fun_name", "?"))]
        program["calls"] += 1
        program["seconds"] += seconds


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and _DIR_VAR not in os.environ:
        # Set before pytest-xdist starts its workers, which inherit the environment.
        os.environ[_DIR_VAR] = tempfile.mkdtemp(prefix="fuseloop-suite-compiles-")
        _made_here.append(os.environ[_DIR_VAR])
    # A directory named by the variable may not exist yet.
    Path(os.environ[_DIR_VAR]).mkdir(parents=True, exist_ok=True)
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_unconfigure(config: pytest.Config) -> None:
    jax.monitoring.unregister_event_listener(_on_event)
    jax.monitoring.unregister_event_duration_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _current[0] = item.nodeid
    yield
    _current[0] = "(between tests)"


def pytest_sessionfinish(session: pytest.Session) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = Path(os.environ[_DIR_VAR]) / f"{worker}.json"
    path.write_text(json.dumps({"tests": _per_test, "programs": _per_program}))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    tests: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    programs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for part in Path(os.environ[_DIR_VAR]).glob("*.json"):
        saved = json.loads(part.read_text())
        for target, source in ((tests, saved["tests"]), (programs, saved["programs"])):
            for key, values in source.items():
                target[key].update(values)
    write = terminalreporter.write_line
    total: collections.Counter[str] = collections.Counter()
    for values in tests.values():
        total.update(values)
    terminalreporter.section("where the suite's JAX time went (bench/suite_compiles.py)")
    write(
        f"compiles {total['compile_s']:.1f} s ({total['cache_misses']} missed the cache, "
        f"{total['cache_hits']} read from it in {total['cache_read_s']:.1f} s), "
        f"lowering {total['lower_s']:.1f} s, tracing {total['trace_s']:.1f} s"
    )
    write("programs by name (compile calls, seconds):")
    ranked = sorted(programs.items(), key=lambda item: -item[1]["seconds"])
    for name, values in ranked[:15]:
        write(f"  {values['seconds']:8.1f} s {values['calls']:6d}  {name}")
    by_file: collections.Counter[str] = collections.Counter()
    for test, values in tests.items():
        by_file[test.split("::")[0]] += values["compile_s"] + values["lower_s"]
    write("test files by compile + lowering seconds:")
    for name, seconds in by_file.most_common(15):
        write(f"  {seconds:8.1f} s  {name}")
    write("tests by compile + lowering seconds (cache misses):")
    heavy = sorted(tests.items(), key=lambda item: -(item[1]["compile_s"] + item[1]["lower_s"]))
    for test, values in heavy[:15]:
        spent = values["compile_s"] + values["lower_s"]
        write(f"  {spent:8.1f} s {values['cache_misses']:5d}  {test}")
    for made in _made_here:
        shutil.rmtree(made, ignore_errors=True)
