"""Start-up refusal: marker ids this model cannot use as markers.

Runs where the span protocol is pinned into the config (user process, and the
engine core for ready-made configs). An id past the model's vocabulary fails
later inside the embedding lookup, far from the option that caused it; BOS or
EOS as a marker turns every prompt's first token, or every answer's end, into
a span boundary. Every field of the protocol is checked alike, so a marker
added to `SpanProtocol` is covered without a change here.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from minipic.protocol import SpanProtocol, SpanProtocolError


class MarkerConfigError(SpanProtocolError):
    """A marker id is outside the vocabulary or is one of the model's BOS/EOS tokens."""


def marker_problems(protocol: SpanProtocol, vocab_size: int,
                    special_ids: Mapping[int, str]) -> list[str]:
    """One line per marker field that cannot work (empty when all can)."""
    problems = []
    for field, token_id in protocol.to_dict().items():
        if token_id >= vocab_size:
            problems.append(f"{field}={token_id} is outside the model's vocabulary "
                            f"(ids 0..{vocab_size - 1})")
        elif token_id in special_ids:
            problems.append(f"{field}={token_id} is the model's {special_ids[token_id]} token")
    return problems


def _ids(value: Any) -> Iterable[int]:
    """A config's token id field: None, an int, or a list of ints (Llama-3.1's eos)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def special_token_ids(model_config: Any) -> dict[int, str]:
    """BOS and EOS ids as the model's config and generation config name them."""
    sources = [model_config.hf_text_config]
    try:  # generation_config.json may list more EOS ids (chat end-of-turn tokens)
        sources.append(model_config.try_get_generation_config())
    except Exception:  # noqa: BLE001 - absent, unreadable or another vLLM's API: config only
        pass
    found: dict[int, str] = {}
    for source in sources:
        getter = source.get if isinstance(source, Mapping) else (
            lambda key, s=source: getattr(s, key, None))
        for key, name in (("bos_token_id", "BOS"), ("eos_token_id", "EOS")):
            for token_id in _ids(getter(key)):
                found.setdefault(token_id, name)
    return found


def check_markers_fit_model(protocol: SpanProtocol, vllm_config: Any) -> None:
    model_config = vllm_config.model_config
    problems = marker_problems(protocol, model_config.get_vocab_size(),
                               special_token_ids(model_config))
    if problems:
        raise MarkerConfigError(
            f"minipic's marker ids cannot be used with {model_config.model}: "
            + "; ".join(problems) + ". Pick unused special tokens (e.g. reserved ones) in "
            "additional_config.minipic, or leave the ids out to use the tokenizer's reserved tokens")
