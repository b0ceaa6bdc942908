"""Chat `documents` as spans without a server: the layout, the refusals, the `recipe`
option at start-up, and a vLLM without the API-server hook points (0.25.1) still loading.
"""

from __future__ import annotations

import logging
import sys

import pytest
from conftest import start_llm

from minipic.client import epic
from minipic.client.prompts.document_spans import document_spans
from minipic.protocol import SpanProtocol
from minipic.serving.chat_documents import (
    DocumentsRequestError, build_span_prompt, document_texts, request_recipe,
)

PROTOCOL = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)


class WordTokenizer:
    """Words to ids 100+ (ids 3..6, the markers, spelled as <3> .. <6>)."""

    def encode(self, text, add_special_tokens=False):
        return [int(w[1:-1]) if w.startswith("<") else 100 + len(w) for w in text.split()]


def test_layout_is_header_spans_links_task():
    header, task = [1, 7, 8], [9, 10, 11]
    prompt = build_span_prompt(header, header + task, ["a bb", "ccc"],
                                    tokenizer=WordTokenizer(), protocol=PROTOCOL, block_size=4,
                                    recipe="epic")
    assert prompt.final == epic([[101, 102], [103]], task, system=header, protocol=PROTOCOL,
                                block_size=4).final
    assert prompt.final[:12] == [1, 7, 8, 5, 3, 101, 102, 5, 3, 103, 5, 5]


def test_long_documents_are_cut_into_the_spans_preload_stores():
    """A document longer than a span: the same spans minipic-preload and RagClient make
    from it (document_spans), so a preloaded document hits from a chat request."""
    long_doc = " ".join(["a"] * 600)  # 600 tokens: two spans of at most 511
    prompt = build_span_prompt([], [9], [long_doc, "ccc"], tokenizer=WordTokenizer(),
                               protocol=PROTOCOL, block_size=4, recipe="block_attention")
    preloaded = document_spans(long_doc, protocol=PROTOCOL, block_size=4,
                               tokenizer=WordTokenizer()) + \
        document_spans("ccc", protocol=PROTOCOL, block_size=4, tokenizer=WordTokenizer())
    assert len(preloaded) == 3
    assert prompt.span_prefills == preloaded
    assert prompt.final[:sum(map(len, preloaded))] == [t for span in preloaded for t in span]


def test_header_that_is_not_a_prefix_is_refused():
    with pytest.raises(DocumentsRequestError, match="cannot place documents"):
        build_span_prompt([1, 7], [1, 8, 9], ["a"], tokenizer=WordTokenizer(),
                               protocol=PROTOCOL, block_size=4, recipe="epic")


def test_document_that_spells_a_marker_is_refused():
    with pytest.raises(DocumentsRequestError, match="documents.1. contains the SSep marker"):
        build_span_prompt([], [9], ["a", "b <3>"], tokenizer=WordTokenizer(),
                               protocol=PROTOCOL, block_size=4, recipe="block_attention")


def test_document_texts():
    assert document_texts([{"text": "x"}, {"title": "t", "text": "y"}]) == ["x", "t\ny"]
    for bad, reason in [([], "non-empty list"), ([{"text": "  "}], "no text"),
                        ([{"text": "x", "title": 3}], "title"), (["x"], "must be an object")]:
        with pytest.raises(DocumentsRequestError, match=reason):
            document_texts(bad)


def test_request_recipe_override_and_default():
    assert request_recipe(None, "epic") == "epic"
    assert request_recipe({"minipic_recipe": "block_attention"}, "epic") == "block_attention"
    with pytest.raises(DocumentsRequestError, match="minipic_recipe"):
        request_recipe({"minipic_recipe": "x"}, "epic")


def test_bad_recipe_option_is_refused_at_start(tiny_model):
    with pytest.raises(ValueError,
                       match="minipic.recipe must be one of 'epic64', 'epic', 'epic2', 'block_attention'"):
        start_llm(tiny_model, additional_config={"minipic": {"recipe": "blockattention"}})


@pytest.mark.parametrize("missing, patch, logged", [
    ("vllm.entrypoints.launchers", "_patch_api_routers", "chat `documents`"),
    ("vllm.entrypoints.openai.chat_completion.serving", "_patch_chat_documents",
     "chat `documents`"),
    ("vllm.entrypoints.openai.completion.serving", "_patch_completion_documents",
     "minipic_documents"),
])
def test_vllm_without_the_hook_points_logs_and_loads(monkeypatch, caplog, missing, patch, logged):
    """vLLM 0.25.1 lays its API server out differently: the feature is off, the plugin loads."""
    from minipic import _vllm_patches

    monkeypatch.setitem(sys.modules, missing, None)  # its import raises ImportError
    caplog.set_level(logging.INFO, logger="vllm.minipic")
    monkeypatch.setattr(logging.getLogger("vllm.minipic"), "propagate", True)
    getattr(_vllm_patches, patch)()
    assert logged in caplog.text


def test_every_server_recipe_has_its_builder():
    """epic2: each document's first two blocks recomputed in context; epic64 its first 64
    tokens, whatever the block size."""
    from minipic.config import SERVER_RECIPES
    from minipic.client.prompts.recipes import RECIPES_BY_NAME as RECIPE_BUILDERS

    assert set(RECIPE_BUILDERS) == set(SERVER_RECIPES)
    header, task = [1, 7, 8], [9, 10, 11]
    long_doc = " ".join(["a"] * 9)  # 9 tokens: three blocks of 4 with its SSep
    prompt = build_span_prompt(header, header + task, [long_doc], tokenizer=WordTokenizer(),
                               protocol=PROTOCOL, block_size=4, recipe="epic2")
    assert prompt.final == epic([[101] * 9], task, system=header, protocol=PROTOCOL,
                                block_size=4, recompute_blocks=2).final
    assert prompt.final != build_span_prompt(header, header + task, [long_doc],
                                             tokenizer=WordTokenizer(), protocol=PROTOCOL,
                                             block_size=4, recipe="epic").final
    # epic64 counts tokens: at 4-token blocks 16 blocks, so the whole 3-block document
    default = build_span_prompt(header, header + task, [long_doc], tokenizer=WordTokenizer(),
                                protocol=PROTOCOL, block_size=4, recipe="epic64")
    assert default.final == epic([[101] * 9], task, system=header, protocol=PROTOCOL,
                                 block_size=4, recompute_blocks=3).final
    assert default.final != prompt.final
