"""rank_list validation and completion (the communicator pool's key)."""

import numpy as np
import pytest

from spmd import SpmdError, SpmdTypeError
from spmd.runtime._communicator import resolve_rank_list


def test_unlisted_ranks_become_groups_of_their_own():
    assert resolve_rank_list([[0, 1, 2]], 4, 0) == ((0, 1, 2), (3,))
    assert resolve_rank_list([[0, 1, 2], [3]], 4, 0) == ((0, 1, 2), (3,))
    assert resolve_rank_list([[1, 2, 3], [0]], 4, 0) == ((1, 2, 3), (0,))
    assert resolve_rank_list([[3]], 4, 0) == ((3,), (0,), (1,), (2,))


def test_list_order_is_kept_and_numpy_ints_are_accepted():
    assert resolve_rank_list(([2, 0], (np.int64(1),)), 3, 0) == ((2, 0), (1,))


@pytest.mark.parametrize(
    "rank_list, message",
    [
        (
            [[0, 1], [1, 2]],
            r"rank 3: rank_list=\[\[0, 1\], \[1, 2\]\] lists rank 1 twice "
            r"\(groups 0 and 1\)",
        ),
        ([[0, 0]], r"lists rank 0 twice \(group 0\)"),
        ([[0, 4]], r"names rank 4, out of range for a world of 4 ranks \(valid: 0..3\)"),
        ([[-1]], r"names rank -1, out of range"),
        ([], r"rank_list=\[\] lists no group"),
        ([[0], []], r"group 1 is empty"),
    ],
)
def test_bad_values(rank_list, message):
    with pytest.raises(SpmdError, match=message):
        resolve_rank_list(rank_list, 4, 3)


@pytest.mark.parametrize(
    "rank_list, message",
    [
        (0, r"rank_list=0 is not a list"),
        ("0,1", r"rank_list='0,1' is not a list"),
        ([0, 1], r"group 0 is 0, not a list of ranks"),
        ([[0, 1.0]], r"group 0 holds 1.0, not an integer rank"),
        ([[True]], r"group 0 holds True, not an integer rank"),
    ],
)
def test_malformed(rank_list, message):
    with pytest.raises(SpmdTypeError, match=message):
        resolve_rank_list(rank_list, 4, 3)
    assert issubclass(SpmdTypeError, TypeError) and issubclass(SpmdTypeError, SpmdError)
    assert issubclass(SpmdError, ValueError)
