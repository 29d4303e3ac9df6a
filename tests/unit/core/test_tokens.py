"""common_prefix_length: chunked at C speed for lists and tuples, exact at every position."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.core.tokens import common_prefix_length


@pytest.mark.parametrize("at", [0, 1, 63, 64, 65, 127, 128, 500, 999])
def test_the_first_difference_is_found_wherever_it_lies(at):
    a = list(range(1000, 2000))  # ids past the small-int cache: compared by value, not identity
    b = list(a)
    b[at] = -1
    assert common_prefix_length(a, b) == at
    assert common_prefix_length(tuple(a), tuple(b)) == at
    assert common_prefix_length(a[:at], b) == at  # one a prefix of the other


@pytest.mark.parametrize(("la", "lb"), [(0, 5), (64, 64), (64, 200), (130, 129), (1000, 1000)])
def test_a_shared_prefix_is_the_shorter_length(la, lb):
    base = list(range(5000, 6200))
    assert common_prefix_length(base[:la], base[:lb]) == min(la, lb)


def test_other_sequence_types_compare_element_by_element():
    a, b = list(range(300)), list(range(300))
    b[200] = 7
    assert common_prefix_length(a, tuple(b)) == 200  # a list and a tuple never equal as slices
    assert common_prefix_length(np.array(a), np.array(b)) == 200
