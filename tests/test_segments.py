"""Which keys a query may see, from the marker blocks of its request."""

import numpy as np

from minipic.attention.segments import block_segment_starts
from minipic.protocol import SpanProtocol

P = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5)


def test_no_markers_sees_everything():
    assert block_segment_starts(np.array([10, 11, 12]), 32, P).tolist() == [0, 0, 0]


def test_ssep_segments_and_pdep_reset():
    # blocks: header, SSep span (2 blocks), SSep span, PDep task, generated
    firsts = np.array([1, 3, 50, 3, 4, 60])
    assert block_segment_starts(firsts, 32, P).tolist() == [0, 32, 32, 96, 0, 0]


def test_span_at_block_zero():
    assert block_segment_starts(np.array([3, 7, 3]), 16, P).tolist() == [0, 0, 32]
