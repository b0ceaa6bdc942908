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


def hashes_in_new_process(python_hash_seed: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if python_hash_seed is not None:
        env["PYTHONHASHSEED"] = python_hash_seed
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_hashes_equal_across_processes_and_hash_seeds():
    runs = [hashes_in_new_process(seed) for seed in (None, "1", "12345")]
    assert len(runs[0]) == 4
    assert runs[0] == runs[1] == runs[2]
