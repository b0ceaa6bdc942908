"""Block hashes are the same in separate processes, whatever PYTHONHASHSEED is.

Each process builds vLLM's own `Request` with minipic's hasher, exactly as the
engine core does, and prints the hashes; stores on disk and replicas rely on
this agreement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.request import Request
from minipic.hashing.block_hasher import make_request_block_hasher
from minipic.protocol import SpanProtocol

protocol = SpanProtocol(3, 4, 5)
hasher = make_request_block_hasher(protocol, 32, get_hash_fn_by_name("sha256"))
doc = [3] + list(range(100, 163))                      # an SSep span, 2 blocks
tokens = list(range(10, 42)) + doc + [4] + list(range(50, 81))  # header, span, PDep block
request = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt="salt",
                  block_hasher=hasher)
print(json.dumps([h.hex() for h in request.block_hashes]))
"""


def start_hashing_process(python_hash_seed: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if python_hash_seed is not None:
        env["PYTHONHASHSEED"] = python_hash_seed
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def hashes_of(process: subprocess.Popen) -> list[str]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_hashes_equal_across_processes_and_hash_seeds():
    # Three processes at once: each spends its time importing vLLM, on one core.
    processes = [start_hashing_process(seed) for seed in (None, "1", "12345")]
    runs = [hashes_of(p) for p in processes]
    assert len(runs[0]) == 4
    assert runs[0] == runs[1] == runs[2]
