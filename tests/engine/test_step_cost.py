"""What a step costs must not grow with what was generated so far (thread CPU time ratios, no wall clock)."""

from __future__ import annotations

import time

from kvscope.engine.config import SamplingParams
from kvscope.engine.outputs import TokenIds
from kvscope.engine.request import Request


def output_cost(num_generated: int, repeats: int = 300) -> int:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100_000, detokenize=False), 0, 0.0)
    request.seqs[0].token_ids.extend(range(num_generated))
    request.output(())
    start = time.thread_time_ns()
    for _ in range(repeats):
        request.output(())
    return time.thread_time_ns() - start


def test_an_output_costs_the_same_after_twenty_thousand_tokens_as_after_one():
    short, long = min(output_cost(1) for _ in range(3)), min(output_cost(20_000) for _ in range(3))
    assert long < 3 * short, (short, long)


def test_an_outputs_token_ids_stay_as_they_were_when_it_was_made():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, detokenize=False), 0, 0.0)
    request.append_token(request.seqs[0], 7, 0.0)
    first = request.output((7,))
    request.append_token(request.seqs[0], 8, 0.0)
    second = request.output((8,))
    assert first.token_ids == (7,) and second.token_ids == (7, 8) and (7, 8) == second.token_ids
    assert list(second.token_ids) == [7, 8] and second.token_ids[-1] == 8 and second.token_ids[:1] == (7,)
    assert (1,) + second.token_ids == (1, 7, 8) and second.samples[0].token_ids == second.token_ids
    assert hash(second.token_ids) == hash((7, 8)) and repr(second.token_ids) == "(7, 8)"


def test_token_ids_index_like_a_tuple():
    ids = TokenIds([9, 9, 1, 2, 3], 2)
    assert [ids[i] for i in range(-3, 3)] == [1, 2, 3, 1, 2, 3]
    for bad in (3, -4):
        try:
            ids[bad]
        except IndexError:
            continue
        raise AssertionError(f"index {bad} should be out of range")


def test_outputs_and_views_built_field_by_field_carry_every_field():
    """Request.output and the snapshot's views build their NamedTuples with tuple.__new__ (cheaper): a field added
    to RequestOutput, SampleOutput or RequestView must be added there too, defaults included."""
    from kvscope.engine.outputs import RequestOutput, RequestView, SampleOutput
    from kvscope.engine.snapshot import request_view

    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, detokenize=False), 0, 0.0)
    output = request.output(())
    assert len(output) == len(RequestOutput._fields) and len(output.samples[0]) == len(SampleOutput._fields)

    class Pool:
        block_size = 16

    view = request_view(request, Pool(), None)
    assert len(view) == len(RequestView._fields) and view.request_id == "r"
