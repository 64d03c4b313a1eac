"""compare/stats.hedges_g's guards, asserted for themselves: without them NumPy's var(ddof=1)
of one value, or a division by a zero pooled std, also gives nan or ±inf, but with a RuntimeWarning
(and ±inf is not the documented nan), so a check of the value alone could not fail."""

from __future__ import annotations

import math
import warnings

import pytest

from compare import stats


@pytest.mark.parametrize("a, b", [([1.0], [3.1, 3.07, 3.12]), ([3.1, 3.07, 3.12], [1.0]), ([1.0], [2.0]), ([], []),
                                  ([3.0, 3.0], [4.0, 4.0]), ([2.5, 2.5, 2.5], [2.5, 2.5])])
def test_hedges_g_is_nan_without_a_warning_for_too_few_values_or_no_spread(a, b):
    """Fewer than 2 values on a side (the docstring's small-sample guard), or a pooled std of 0
    (every value equal within each side, the means differing or not): nan, quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Degrees of freedom <= 0" or "divide by zero" would raise
        g = stats.hedges_g(a, b)
    assert math.isnan(g)
