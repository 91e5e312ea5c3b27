"""`tools/fuzz_equivalence.py` still runs: one small configuration agrees, and a
difference in one bit of the step state is seen (the tool's worth is its comparison)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def fuzz():
    sys.path.insert(0, str(TOOLS))
    try:
        import fuzz_equivalence
    finally:
        sys.path.remove(str(TOOLS))
    return fuzz_equivalence


def test_a_drawn_configuration_runs_and_agrees(fuzz):
    cfg = fuzz.draw(random.Random(0), devices=1)
    small = {"model": "mlp", "src": "list", "n": 16, "bs": 8, "epochs": 2, "e1": 1}
    cfg.update(small, val=None, fuse=2, log=1, observe=1, pop=None, mesh=0)
    assert fuzz.check(cfg) == ("ok", "ok")


def test_a_one_bit_difference_is_a_mismatch(fuzz):
    leaf = np.arange(4, dtype=np.float32)
    flipped = leaf.copy()
    flipped.view(np.uint32)[2] ^= 1
    same = ("ok", [leaf], "state", "[]", "log")
    assert fuzz.disagreement(same, same) == ""
    assert fuzz.disagreement(same, ("ok", [flipped], "state", "[]", "log")) == "step state leaf 0"
    assert fuzz.disagreement(same, ("ok", [leaf], "state", "[]", "log!")).startswith("log")
    assert fuzz.disagreement(("error", "ValueError", "x"), ("error", "ValueError", "x")) == ""
