"""A request's lengths (`ReqLens`) over its life, and an n-token append at the Req level."""

from __future__ import annotations

import pytest

from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req

EOS = frozenset({99})


def lens_of(req: Req) -> tuple[int, int, int, int, int]:
    """(cached, computed, kv, seq, max_kv), after checking the invariant."""
    req.lens.check()
    assert req.lens.output_len == len(req.output_ids)
    n = req.lens
    return n.cached_len, n.computed_len, n.kv_len, n.seq_len, n.max_kv_len


def test_lengths_over_a_request_life() -> None:
    req = Req(0, list(range(10)), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert lens_of(req) == (0, 0, 0, 10, 15)
    req.lens.cached_len, req.lens.computed_len = 4, 8  # admitted: 4 on device, 4 loaded
    assert lens_of(req) == (4, 8, 8, 10, 15)
    req.lens.computed_len += 2  # the last prefill chunk, which samples the first token
    assert req.append_outputs([7], EOS) == 1
    assert lens_of(req) == (4, 10, 10, 11, 15)
    req.lens.cached_len = 8  # the prompt's full pages went into the tree (page size 4)
    assert req.append_outputs([], EOS) == 0  # n = 0: nothing changes
    assert lens_of(req) == (8, 10, 10, 11, 15) and req.finish_reason is None
    assert req.append_outputs([1, 2, 3], EOS) == 3  # n = 3
    assert lens_of(req) == (8, 10, 13, 14, 15) and req.output_ids == [7, 1, 2, 3]
    assert req.append_outputs([4, 5, 6], EOS) == 2  # the 6th output finishes it: 6 dropped
    assert lens_of(req) == (8, 10, 15, 16, 15) and req.finish_reason == "length"
    assert req.output_ids == [7, 1, 2, 3, 4, 5]


def test_an_append_stops_at_the_first_stop_or_eos_token() -> None:
    req = Req(1, [5, 6], SamplingParams(max_new_tokens=10, stop_token_ids=(42,)))
    req.lens.computed_len = 2
    assert req.append_outputs([1, 42, 3], EOS) == 2 and req.finish_reason == "stop"
    assert req.output_ids == [1, 42] and lens_of(req)[2:4] == (3, 4)
    eos = Req(2, [5, 6], SamplingParams(max_new_tokens=10))
    eos.lens.computed_len = 2
    assert eos.append_outputs([99, 1], EOS) == 1 and eos.finish_reason == "stop"
    ignored = Req(3, [5, 6], SamplingParams(max_new_tokens=10, ignore_eos=True))
    ignored.lens.computed_len = 2
    assert ignored.append_outputs([99, 1], EOS) == 2 and ignored.finish_reason is None


def test_check_names_a_broken_invariant() -> None:
    req = Req(4, list(range(8)), SamplingParams(max_new_tokens=2))
    req.lens.cached_len, req.lens.computed_len = 8, 4  # the tree holds more than computed
    with pytest.raises(AssertionError):
        req.lens.check()
    req.lens.cached_len, req.lens.computed_len = 0, 9  # more than the prompt
    with pytest.raises(AssertionError):
        req.lens.check()
