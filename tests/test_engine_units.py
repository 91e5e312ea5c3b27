"""Small engine pieces checked against their references."""

from __future__ import annotations

import itertools

from fuseloop._events import Filter


def test_filter_offsets_match_testing_every_count() -> None:
    keys = itertools.product([None, 1, 2, 3, 7], [None, 1, 5, 30], [None, 0, 3, 20],
                             [None, 1, 4, 25])
    for every, before, after, once in keys:
        spec = Filter(every, before, after, once)
        for first in range(1, 40):
            for n in range(12):
                expected = [j for j in range(n) if spec.by_count(first + j)]
                assert list(spec.offsets(first, n)) == expected, (spec, first, n)
