"""Chat requests with `documents` against the real OpenAI server: spans without knowing KV blocks.

One server (CPU, tiny model, minipic on, block size 32, a chat template given with
--chat-template since the tiny tokenizer has none) answers the official `openai`
client. The expected prompts and hit counts come from minipic.client's builders,
fed with the same chat template rendered locally by transformers.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from conftest import BLOCK_SIZE, api_server

from minipic.client import block_attention
from minipic.client.prompts.recipes import RECIPES_BY_NAME, blocks_for_tokens
from minipic.protocol import SpanProtocol

pytestmark = pytest.mark.engine

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . "
            "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
PROTOCOL = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)
SYSTEM = {"role": "system", "content": "you are a helpful assistant . read the following"}
QUESTION = {"role": "user", "content": "what is the capital of france ?"}
# Different lengths, so reordering moves each document to another offset.
DOC_A = {"title": "france", "text": "paris is the capital of france . " * 6}
DOC_B = {"text": "berlin is the capital of germany . the river of berlin . " * 9}
MAX_MODEL_LEN = 1024
API_KEY = "chat-documents-key"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-documents")
    (folder / "template.jinja").write_text(TEMPLATE)
    with api_server(tiny_model, folder / "server.log", "--max-model-len", str(MAX_MODEL_LEN),
                    "--chat-template", str(folder / "template.jinja"), "--api-key", API_KEY,
                    "--additional-config", json.dumps({"minipic": {}})) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def chat(client, messages, documents=None, **extra):
    body = {"return_token_ids": True, **extra.pop("extra_body", {})}
    if documents is not None:
        body["documents"] = documents
    model = client.models.list().data[0].id
    extra = {"max_tokens": 6, "temperature": 0, **extra}
    return client.chat.completions.create(model=model, messages=messages, extra_body=body,
                                          **extra)


def rendered(tokenizer, messages, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True,
                                        add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def expected_prompt(tokenizer, messages, documents, recipe=RECIPES_BY_NAME["epic64"]):
    """The span prompt minipic.client builds for the same conversation and documents."""
    system = [m for m in messages if m["role"] == "system"]
    header = rendered(tokenizer, system, False) if system else []
    whole = rendered(tokenizer, messages, True)
    bodies = [tokenizer.encode(f"{d['title']}\n{d['text']}" if "title" in d else d["text"],
                               add_special_tokens=False) for d in documents]
    return recipe(bodies, whole[len(header):], system=header or None, protocol=PROTOCOL,
                  block_size=BLOCK_SIZE)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def prompt_ids(response) -> list[int]:
    return response.model_extra["prompt_token_ids"]


def test_reordered_documents_hit_at_their_new_offsets(client, tokenizer):
    messages = [SYSTEM, QUESTION]
    first = chat(client, messages, [DOC_A, DOC_B])
    expected_first = expected_prompt(tokenizer, messages, [DOC_A, DOC_B])
    assert prompt_ids(first) == expected_first.final

    second = chat(client, messages, [DOC_B, DOC_A])
    expected = expected_prompt(tokenizer, messages, [DOC_B, DOC_A])
    assert prompt_ids(second) == expected.final
    header_and_spans = len(expected.final) - len(expected_first.final) + \
        expected_first.expected_cached_tokens  # same length: header + both spans
    assert cached(second) == expected.expected_cached_tokens == header_and_spans
    assert cached(second) > len(tokenizer.encode(DOC_B["text"])) + 32


def test_answer_equals_the_client_built_span_prompt(client, tokenizer):
    messages = [SYSTEM, {"role": "user", "content": "who was born in rome ?"}]
    chat(client, messages, [DOC_B, DOC_A])
    answer = chat(client, messages, [DOC_B, DOC_A])
    prompt = expected_prompt(tokenizer, messages, [DOC_B, DOC_A])
    model = client.models.list().data[0].id
    same = client.completions.create(model=model, prompt=prompt.final, max_tokens=6,
                                     temperature=0)
    assert answer.choices[0].message.content == same.choices[0].text
    # Same header and documents in the same order as the call before: the link blocks
    # (64 tokens per document in whole blocks, or the whole span when shorter; hashed over
    # everything before them) hit as well.
    spans = prompt.span_prefills[1:]  # after the header
    links = sum(min(blocks_for_tokens(64, BLOCK_SIZE) * BLOCK_SIZE, len(span)) for span in spans)
    assert links == 4 * BLOCK_SIZE
    assert cached(answer) == prompt.expected_cached_tokens + links


def test_block_attention_per_request_and_no_system_message(client, tokenizer):
    messages = [QUESTION]
    response = chat(client, messages, [DOC_A],
                    extra_body={"vllm_xargs": {"minipic_recipe": "block_attention"}})
    assert prompt_ids(response) == expected_prompt(tokenizer, messages, [DOC_A],
                                                   block_attention).final


def test_streaming_n_and_cache_salt(client, tokenizer):
    messages = [SYSTEM, QUESTION]
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"documents": [DOC_A, DOC_B]}))
    expected = expected_prompt(tokenizer, messages, [DOC_A, DOC_B])
    assert chunks[-1].usage.prompt_tokens == len(expected.final)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = chat(client, messages, [DOC_A, DOC_B], max_tokens=4)
    assert streamed and streamed == whole.choices[0].message.content  # the same span prompt

    two = chat(client, messages, [DOC_B, DOC_A], n=2, temperature=1.0, seed=0)
    assert len(two.choices) == 2 and all(c.message.content for c in two.choices)
    assert prompt_ids(two) == expected_prompt(tokenizer, messages, [DOC_B, DOC_A]).final

    salted = [chat(client, messages, [DOC_A, DOC_B], extra_body={"cache_salt": "tenant-x"})
              for _ in range(2)]
    assert cached(salted[0]) == 0  # another tenant's spans are not shared
    assert cached(salted[1]) > 0


def test_tools_keep_working(client, tokenizer):
    """A request with tools and documents is served from the span prompt (this template
    does not render tools; one that does sees them in both of minipic's renderings)."""
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": "look a city up",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    response = chat(client, [SYSTEM, QUESTION], [DOC_A], tools=tools, tool_choice="none")
    assert response.choices[0].message.content
    assert prompt_ids(response) == expected_prompt(tokenizer, [SYSTEM, QUESTION], [DOC_A]).final


def test_request_without_documents_is_untouched(client, tokenizer):
    messages = [SYSTEM, QUESTION]
    assert prompt_ids(chat(client, messages)) == rendered(tokenizer, messages, True)


@pytest.mark.parametrize("documents, reason", [
    ([{"text": ""}], "documents[0] has no text"),
    ([DOC_A, {"title": "no text"}], "documents[1] has no text"),
    ([{"text": "paris", "url": "x"}], "documents[0] has unknown key(s) 'url'"),
    ([{"text": "paris is a city . " * 400}], "leaves no room to generate within max_model_len"),
    ([{"text": 5}], "documents"),            # not a string: vLLM's own request validation
    (["paris is a city"], "documents"),
])
def test_bad_documents_are_a_400_with_the_reason(client, documents, reason):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, [SYSTEM, QUESTION], documents)
    assert error.value.status_code == 400
    assert reason in error.value.message


def test_unknown_recipe_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, [SYSTEM, QUESTION], [DOC_A],
             extra_body={"vllm_xargs": {"minipic_recipe": "fancy"}})
    assert "vllm_xargs.minipic_recipe must be one of 'epic64', 'epic', 'epic2', 'block_attention'" in \
        error.value.message


def test_settings_route_publishes_block_size_and_markers(server):
    url = f"{server}/v1/minipic/settings"
    with pytest.raises(urllib.error.HTTPError) as refused:  # --api-key guards it
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        settings = json.load(response)
    assert settings["block_size"] == BLOCK_SIZE
    assert settings["span_protocol"] == PROTOCOL.to_dict()
    assert settings["recipe"] == "epic64"  # the server's default
    assert settings["max_model_len"] == MAX_MODEL_LEN


def complete(client, prompt, xargs):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"vllm_xargs": xargs, "return_token_ids": True})


def test_completions_take_documents_in_vllm_xargs(client, tokenizer):
    prompt = "question : who was born in rome ? answer :"
    system = "you are a helpful assistant"
    texts = [DOC_A["text"], "rome is the capital of italy . " * 5]
    responses = [complete(client, prompt, {"minipic_documents": docs, "minipic_system": system})
                 for docs in (texts, texts[::-1])]
    ids = tokenizer.encode(prompt)  # as vLLM tokenizes a completion prompt
    lead = ids[:1] if ids[:1] == [tokenizer.bos_token_id] else []
    header = lead + tokenizer.encode(system, add_special_tokens=False)
    default = RECIPES_BY_NAME["epic64"]  # the server's default
    expected = default([tokenizer.encode(t, add_special_tokens=False) for t in texts[::-1]],
                     ids[len(lead):], system=header, protocol=PROTOCOL, block_size=BLOCK_SIZE)
    assert responses[1].choices[0].prompt_token_ids == expected.final
    assert cached(responses[1]) == expected.expected_cached_tokens > 2 * BLOCK_SIZE


def test_completions_with_bad_documents_are_a_400(client):
    for xargs, reason in [({"minipic_documents": []}, "non-empty list"),
                          ({"minipic_documents": ["paris", 3]}, "minipic_documents[1]"),
                          ({"minipic_documents": ["paris"], "minipic_recipe": "x"},
                           "minipic_recipe")]:
        with pytest.raises(openai.BadRequestError) as error:
            complete(client, "what ?", xargs)
        assert reason in error.value.message
