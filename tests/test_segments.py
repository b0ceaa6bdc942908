"""Which keys a query may see, from the marker blocks of its request."""

import pytest
import torch

from minipic.attention.segments import segment_start_table
from minipic.protocol import SpanProtocol

P = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5)


def table(*rows, block_size=32):
    return segment_start_table(torch.tensor(rows), P, block_size).tolist()


def test_no_markers_sees_everything():
    assert table([10, 11, 12]) == [[0, 0, 0]]


def test_ssep_segments_and_pdep_reset():
    # blocks: header, SSep span (2 blocks), SSep span, PDep task, generated
    assert table([1, 3, 50, 3, 4, 60]) == [[0, 32, 32, 96, 0, 0]]


def test_rows_are_independent_and_span_at_block_zero():
    assert table([3, 7, 3], [7, 7, 3], block_size=16) == [[0, 0, 32], [0, 0, 32]]


def test_markers_in_generated_tokens_are_ignored():
    firsts = torch.tensor([[1, 3, 50, 3]])  # the second SSep is a generated token
    starts = segment_start_table(firsts, P, 32, prompt_lens=torch.tensor([96]))
    assert starts.tolist() == [[0, 32, 32, 32]]


def test_a_second_live_engine_in_one_process_is_refused():
    from minipic.attention import segments

    class Runner:  # stands for a model runner: only its identity matters here
        pass

    first, second = Runner(), Runner()
    segments.register_runner(first, P)
    with pytest.raises(segments.OneEnginePerProcessError, match="one engine per process"):
        segments.register_runner(second, P)
    del first  # shut down: the next engine may start
    segments.register_runner(second, P)
    del second
