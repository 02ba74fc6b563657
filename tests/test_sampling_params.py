"""SamplingParams is validated once, where it is built, and every path refuses a bad value with the
same exception type (InvalidRequest, a DFlashError: one line, what, the value, the fix)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_trt.errors import DFlashError, InvalidRequest
from dflash_trt.sampling_params import DEFAULT_MAX_TOKENS, GREEDY, SamplingParams


@pytest.mark.parametrize("kw, fragment", [
    ({"temperature": math.nan}, "temperature=nan is not a finite number"),
    ({"temperature": math.inf}, "temperature=inf is not a finite number"),
    ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
    ({"temperature": "hot"}, "temperature='hot' is not a number"),
    ({"top_p": math.nan}, "top_p=nan is not a finite number"),
    ({"top_p": 0.0}, "top_p=0.0 must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1]"),
    ({"top_p": -math.inf}, "top_p=-inf is not a finite number"),
    ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
    ({"max_tokens": 2.5}, "max_tokens=2.5 is not an integer"),
    ({"max_tokens": True}, "max_tokens=True is not an integer"),
    ({"seed": -1}, "seed=-1 is outside 0.."),
    ({"seed": 2**64}, "is outside 0.."),
    ({"stop": [1, 2]}, "must be a list of strings"),
    ({"stop_token_ids": [3, -1]}, "has a negative id"),
    ({"stop_token_ids": "2"}, "must be a list of token ids"),
])
def test_bad_values_raise_one_line_invalid_request(kw, fragment):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kw)
    assert isinstance(err.value, DFlashError) and err.value.exit_code == 2
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert ";" in str(err.value)  # what failed; then the fix


def test_values_are_normalised_once():
    p = SamplingParams(max_tokens=np.int32(7), temperature=np.float32(0.5), top_p=1, seed=np.uint64(3),
                       stop="END", stop_token_ids=[2, 2, 5])
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (7, 0.5, 1.0, 3)
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.seed) is int
    assert p.stop == ("END",) and p.stop_token_ids == (2, 5)
    assert SamplingParams(stop=["", "x"]).stop == ("x",)  # an empty stop string would end at once
    assert GREEDY.greedy and not p.greedy


def test_derived_copies_are_validated_again():
    p = SamplingParams(max_tokens=4, stop_token_ids=(1,))
    assert p.with_stop_token_ids([9, 1]).stop_token_ids == (1, 9)
    assert p.resolve_max_tokens(100) == 4 and SamplingParams().resolve_max_tokens() == DEFAULT_MAX_TOKENS
    with pytest.raises(InvalidRequest, match="temperature=nan"):
        p.replace(temperature=float("nan"))
    with pytest.raises(Exception):  # frozen: no way around validation
        p.temperature = -1.0  # type: ignore[misc]
    assert p.to_dict() == {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": [],
                           "stop_token_ids": [1]}
