"""A compiled engine at vLLM's defaults (memory share 0.9, context length, capture sizes
and request limit) starts on a Llama-3-8B-shaped model with minipic's full graphs, prefill
graphs on, and serves a span hit, its question from a prefill graph.

Model Runner V2 does not profile CUDA graph memory: what the capture keeps comes out of the
tenth of the card vLLM leaves beside its share (7.9 GiB on an H100), and once ran past it
(docs/benchmarks.md, "Span hit TTFT").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minipic.devtools.llama3_8b import MARKERS, write_config
from minipic.devtools.plugin_site import REPO, plugin_env
from minipic.devtools.span_paths import count_span_paths

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK_SIZE = 16  # vLLM's default on CUDA


def _child(model_dir: str, out_path: str) -> None:
    """The engine at vLLM's defaults; a Block-Attention prompt's spans, then its hit."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.protocol import SpanProtocol

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", seed=0,
              additional_config={"minipic": {**MARKERS, "prefill_graphs": True}})
    calls = count_span_paths()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128000, (n,), generator=gen).tolist() for n in (900, 700, 1100)]
    question = torch.randint(0, 128000, (40,), generator=gen).tolist()
    prompt = RECIPES_BY_NAME["block_attention"](docs, question, protocol=SpanProtocol(**MARKERS),
                                                block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in prompt.span_prefills], params,
                 use_tqdm=False)
    before_hit = calls["graph_prefill_steps"]
    hit = llm.generate([TokensPrompt(prompt_token_ids=prompt.final)], params, use_tqdm=False)[0]
    Path(out_path).write_text(json.dumps({
        "cached_tokens": hit.num_cached_tokens, "expected": prompt.expected_cached_tokens,
        "tokens": list(hit.outputs[0].token_ids),
        "hit_prefill_graph_steps": calls["graph_prefill_steps"] - before_hit}))


if __name__ == "__main__":
    _child(*sys.argv[1:])


def test_a_compiled_engine_at_vllms_defaults_starts_and_serves_a_hit(tmp_path):
    pytest.importorskip("vllm")
    model_dir = write_config(tmp_path / "llama3-8b-shaped")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(out)],
                          env=plugin_env(tmp_path), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["cached_tokens"] == result["expected"], result
    assert len(result["tokens"]) == 4, result
    assert result["hit_prefill_graph_steps"] == 1, result  # its 41 computed tokens: one step
