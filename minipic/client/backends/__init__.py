"""Where prompts go: an OpenAI-compatible vLLM server or an in-process vLLM engine.

Every client tool (preload, RAG client, ISPS) talks to a `CompletionBackend`:
one coroutine that sends a token-id prompt and returns a `Completion` with the
engine's cached-token count, which is how the tools see span hits.

    backend = await OpenAIServerBackend.connect("http://localhost:8000", block_size=16)
    backend = AsyncLLMBackend(async_llm)           # in-process, asyncio
    backend = LLMBackend(llm)                      # in-process, vllm.LLM (one call at a time)
"""

from minipic.client.backends.base import Completion, CompletionBackend
from minipic.client.backends.in_process import AsyncLLMBackend, LLMBackend
from minipic.client.backends.openai_server import OpenAIServerBackend

__all__ = ["AsyncLLMBackend", "Completion", "CompletionBackend", "LLMBackend",
           "OpenAIServerBackend"]
