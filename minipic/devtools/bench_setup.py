"""What the GPU/CPU benchmarks share to set up engines and inputs: the model, its token ids,
the connector's options and the command-line parsers of sizes, lists and disk phases.

tools/bench_ttft.py and tools/bench_rag.py both use it, so that a benchmark script does not
import another one, and both build the same engine and the same kind of prompts.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

TINY_MARKERS = {"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5, "link_token_id": 6}

DEFAULT_DISK_PHASES = ["warm:4"]


# KV block size of each architecture's engine (the tiny model runs on CPU attention, which
# wants a multiple of 32).
BLOCK_SIZES = {"tiny": 32, "llama3-8b": 16}


def make_model(arch: str, root: Path, max_model_len: int = 0) -> tuple[str, dict, dict]:
    """Model dir, engine kwargs and marker ids for the chosen architecture; the engine takes
    prompts of max_model_len tokens at least (the tiny model's positions are made to reach)."""
    if arch == "tiny":
        from minipic.devtools.tiny_llama import build_tiny_llama

        length = max(4096, max_model_len)
        path = build_tiny_llama(root / "tiny", max_position_embeddings=length)
        return str(path), dict(dtype="float32", block_size=BLOCK_SIZES[arch], enforce_eager=True,
                               gpu_memory_utilization=0.1, max_model_len=length), TINY_MARKERS
    from minipic.devtools import llama3_8b

    path = llama3_8b.write_config(root / "llama3-8b")
    return str(path), dict(dtype="bfloat16", block_size=BLOCK_SIZES[arch], load_format="dummy",
                           skip_tokenizer_init=True, gpu_memory_utilization=0.85,
                           max_model_len=max(32768, max_model_len)), llama3_8b.MARKERS


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """KV cache bytes one token takes in the model at `model_dir` (its config.json)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width


def connector_extra(arch: str, store: str, markers: dict, cpu_bytes: int | None = None) -> dict:
    """MiniPICConnector options. The 8B model gets an 8 GiB CPU tier unless told otherwise:
    4 steps of 16384 tokens, so that span bursts reach the store whole (minipic's
    cpu_tier_sizing warns below 2 steps; the 2 GiB default drops stores at this size). A
    prompt's loads pass through the tier too: 40 documents of 1000 tokens need 5 GiB of it."""
    extra = {"store_dir": store, **markers}
    if cpu_bytes or arch == "llama3-8b":
        extra["cpu_bytes"] = cpu_bytes or 8 << 30
    return extra


def random_words(rng: random.Random, arch: str):
    """n random ordinary token ids (above every special and marker id of either model)."""
    vocab = 400 if arch == "tiny" else 120000
    return lambda n: [rng.randrange(10, vocab) for _ in range(n)]


def add_minipic_option(parser: argparse.ArgumentParser, where: str = "") -> None:
    """The `--minipic-option KEY=VALUE` argument (repeatable), read by minipic_option_pairs."""
    parser.add_argument("--minipic-option", action="append", metavar="KEY=VALUE",
                        help="into every minipic engine's options (additional_config.minipic "
                             f"or the connector's), e.g. mask_markers=true (repeatable{where})")


def minipic_option_pairs(pairs: list[str] | None) -> dict[str, Any]:
    """`--minipic-option KEY=VALUE` pairs for additional_config.minipic; VALUE is read as
    JSON when it parses (true, 3, "x"), else kept as a string."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--minipic-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def gib(size: float | None) -> int | None:
    return int(size * 2**30) if size else None


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def split_disk_phase(spec: str) -> tuple[str, str, list[str]]:
    """`warm:4` -> ("warm", "4", []), `warm:16:0` -> ("warm", "16", ["0"]): kind, read threads
    and reader processes (tools/bench_ttft.py's docstring says what they mean). The numbers
    stay text, so that a phase's name is the spec as written."""
    kind, *numbers = spec.split(":")
    if kind not in ("warm", "cold") or len(numbers) not in (1, 2) \
            or not all(x.isdigit() for x in numbers):
        raise argparse.ArgumentTypeError(
            f"bad disk phase {spec!r}: warm|cold:THREADS[:PROCESSES]")
    threads, *processes = numbers
    return kind, threads, processes


def disk_phase_list(text: str) -> list[str]:
    """`warm:4,cold:16`, checked while parsing: a typo fails now, not after the first phases;
    `none`: no disk phase."""
    if text == "none":
        return []
    specs = text.split(",")
    for spec in specs:
        split_disk_phase(spec)
    return specs
