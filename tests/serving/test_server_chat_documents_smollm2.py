"""The README's quick start, as written, against the real SmolLM2-135M-Instruct on the real
OpenAI server (CPU, minipic on, the model's own chat template): a plain `openai` client sends
the same documents twice in two orders, and the second call's cached tokens cover them.
"""

from __future__ import annotations

import openai
import pytest
from conftest import BLOCK_SIZE

from minipic.client import epic

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

DOCS = [
    {"title": "Lake Orvin", "text": "Lake Orvin is the deepest lake of the country of Talvia. "
     "It lies north of the capital, Merivale, and freezes every winter."},
    {"title": "Merivale", "text": "Merivale is the capital of Talvia. It was founded in 1712 "
     "by fishermen and is known for its blue bridges and its spring flower market."},
]
MESSAGES = [{"role": "system", "content": "Answer from the documents, in one short sentence."},
            {"role": "user", "content": "What is the capital of Talvia?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    # max_model_len 2048, the model's markers (conftest.py; shared with test_smollm2.py)
    return openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="EMPTY", max_retries=0)


def ask(client, documents):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=20, temperature=0,
        extra_body={"documents": documents, "return_token_ids": True})


def test_second_call_with_reordered_documents_reuses_them(client, smollm2_model):
    from transformers import AutoTokenizer

    from minipic.devtools.smollm2 import smollm2_protocol
    from minipic.protocol import SpanProtocol

    ask(client, DOCS)
    second = ask(client, DOCS[::-1])

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    header = tokenizer.apply_chat_template(MESSAGES[:1], tokenize=False)
    whole = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    header_ids = tokenizer.encode(header, add_special_tokens=False)
    bodies = [tokenizer.encode(f"{d['title']}\n{d['text']}", add_special_tokens=False)
              for d in DOCS[::-1]]
    expected = epic(bodies, tokenizer.encode(whole, add_special_tokens=False)[len(header_ids):],
                    system=header_ids, protocol=SpanProtocol.from_dict(smollm2_protocol()),
                    block_size=BLOCK_SIZE, recompute_tokens=64)  # the server's default
    assert second.model_extra["prompt_token_ids"] == expected.final
    documents_tokens = sum(map(len, bodies))
    assert second.usage.prompt_tokens_details.cached_tokens == expected.expected_cached_tokens
    assert expected.expected_cached_tokens > documents_tokens  # header and every document
    assert "Merivale" in second.choices[0].message.content
