"""The span protocol: marker ids, and which prompts' markers and links can act."""

import random

import pytest

from minipic.protocol import MisplacedMarkerError, SpanProtocol, SpanProtocolError

P = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)
B = 2


def blocks(*firsts):
    """A prompt whose blocks start with `firsts` (9: a plain token)."""
    return [t for first in firsts for t in (first, 9)]


def test_link_is_optional_and_kept_out_of_old_dicts():
    old = SpanProtocol.from_dict({"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5})
    assert old.link_token_id is None and 6 not in old.markers
    assert old.to_dict() == {"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5}
    assert SpanProtocol.from_dict(P.to_dict()) == P
    assert P.markers == {3, 4, 6}


def test_marker_ids_must_differ():
    with pytest.raises(SpanProtocolError, match="must be different"):
        SpanProtocol(3, 4, 5, link_token_id=3)


def test_links_that_follow_their_spans_pass():
    P.check_marker_placement(blocks(1, 3, 9, 3, 6, 9, 6, 4), B)  # link 1 is 2 blocks


def test_a_link_before_its_span_is_refused_with_its_position():
    with pytest.raises(MisplacedMarkerError, match="prompt token 4 starts link block 2, but "
                                                   "only 1 SSep span"):
        P.check_marker_placement(blocks(3, 6, 6, 3, 4), B)


def test_a_link_longer_than_its_span_is_refused():
    with pytest.raises(MisplacedMarkerError, match="prompt token 4 starts link block 1, 2 "
                                                   "blocks long, but span 1 is 1 block"):
        P.check_marker_placement(blocks(1, 3, 6, 9), B)


def test_a_link_inside_a_block_is_refused():
    with pytest.raises(MisplacedMarkerError, match="prompt token 3 is minipic's link marker"):
        P.check_marker_placement([3, 9, 9, 6], B)


def test_without_a_link_id_the_token_is_text():
    SpanProtocol(3, 4, 5).check_marker_placement(blocks(6, 6, 3), B)


def test_a_pdep_block_between_a_span_and_its_link_is_refused():
    """Its queries would not see span 1's head, hidden for the link that comes later,
    and its PDep hash does not cover that link (a cached block with the wrong KV)."""
    with pytest.raises(MisplacedMarkerError, match="prompt token 6 starts a PDep block "
                                                   "between span 1 and its link"):
        P.check_marker_placement(blocks(1, 3, 9, 4, 6, 4), B)
    P.check_marker_placement(blocks(1, 3, 6, 3, 4), B)  # span 2 has no link: fine
    P.check_marker_placement(blocks(1, 3, 3, 6, 6, 4, 9), B)  # links, then the task


def test_a_second_run_of_links_is_refused():
    """What follows the links stands as many positions earlier as they hold: a second
    run would move tokens whose KV an earlier prompt already computed and cached."""
    with pytest.raises(MisplacedMarkerError, match="prompt token 8 starts a second run of "
                                                   "link blocks"):
        P.check_marker_placement(blocks(1, 3, 6, 3, 6, 4), B)
    P.check_marker_placement(blocks(1, 3, 9, 3, 6, 9, 6, 4, 9), B)  # one run, link 1 of 2 blocks


@pytest.mark.parametrize("seed", range(40))
def test_a_marker_inside_a_block_is_refused_at_its_first_position(seed):
    """Against a plain loop over every token: block starts may hold SSep and PDep (which need
    no link order), any other position of any marker (links too) refuses the prompt, the
    error names the first one; list and tuple prompts and a partial last block alike."""
    rng = random.Random(seed)
    protocol, block_size = SpanProtocol(3, 4, 5, link_token_id=6), rng.choice([2, 4, 16])
    tokens = [rng.choice([3, 4, 5, 9, 9, 9]) if i % block_size == 0
              else rng.choice([3, 4, 6]) if rng.random() < 0.01 else rng.choice([5, 9, 10])
              for i in range(rng.randrange(1, 400))]
    misplaced = [i for i, t in enumerate(tokens) if i % block_size and t in (3, 4, 6)]
    for prompt in (tokens, tuple(tokens)):
        if not misplaced:
            protocol.check_marker_placement(prompt, block_size)
            continue
        name = {3: "SSep", 4: "PDep", 6: "link"}[tokens[misplaced[0]]]
        with pytest.raises(MisplacedMarkerError,
                           match=f"prompt token {misplaced[0]} is minipic's {name} marker"):
            protocol.check_marker_placement(prompt, block_size)
