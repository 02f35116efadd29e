"""Request bookkeeping: token slices across the prompt / output boundary."""

from __future__ import annotations

import pytest

from moeserve.core.request import Request
from moeserve.core.sampling_params import SamplingParams


@pytest.mark.parametrize("start,end", [(0, 5), (1, 4), (3, 5), (0, 2), (4, 5), (2, 2), (0, 3), (3, 3)])
def test_token_slice_matches_the_joined_tokens(start, end):
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    req.output_token_ids = [4, 5]
    assert req.token_slice(start, end) == req.all_token_ids[start:end]
