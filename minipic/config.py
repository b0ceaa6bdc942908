"""The one switch: is minipic on for this vLLM instance, and with which options.

minipic is on when either
  * `additional_config={"minipic": {...}}` is given (`--additional-config` on
    the CLI), or
  * minipic's connector is the `--kv-transfer-config` connector (it implies
    minipic; its `kv_connector_extra_config` may carry the same options).
Both live in vLLM's config, which reaches the engine-core and worker processes
and is part of vLLM's torch.compile cache key, so a graph compiled without
minipic is never reused with it.

Options (all optional): the span protocol's marker ids `ssep_token_id`,
`pdep_token_id`, `pad_token_id`, ... (default: the tokenizer's reserved special
tokens), `enabled` (false turns an `additional_config` section off),
`mask_markers` (true: marker and padding keys are hidden from every query
outside their own span and take no room in positions; see docs/accuracy.md for
what it does to answers), `span_scale` (CPU only for now: a query outside spans
weights each key of an SSep span, computed alone, by this factor before the softmax
normalises: APE's scale S, 1 = as computed; docs/accuracy.md), `recipe` (the
span prompt the API server builds from a chat request's `documents`: "epic64",
the default (each document's first 64 tokens recomputed, in whole blocks), "epic2"
(two blocks), "epic" (one) or "block_attention"; see minipic/serving/chat_documents.py), `span_attention` (CUDA,
fp16/bf16 models: "flash" attends span batches with vLLM's own FlashAttention, one call
per frame merged by log-sum-exp; "triton" with minipic's span kernel, which mask_markers
batches always take; "auto", the default, FlashAttention but for short span prefills
run eagerly (not replayed as CUDA graphs), such as a span hit's question, which the
kernel attends in one launch a layer; see docs/attention.md), `prefill_graphs` (CUDA,
compiled, experimental, false by default: true captures full CUDA graphs in which a span
hit's question of up to 128 tokens runs on the FlashAttention rows, where it otherwise
runs piecewise, its attention eager; see docs/attention.md), `switch_interval_ms` (the
GIL's switch interval in the engine processes, 0.2 by default, null for Python's 5;
see minipic/switch_interval.py). Any other
key in the `additional_config` section is refused at start-up (a typo would
otherwise silently leave a default in force).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from minipic.protocol import SpanProtocol

CONFIG_KEY = "minipic"
CONNECTOR_NAME = "MiniPICConnector"


def connector_config(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for MiniPICConnector with these options
    (`kv_connector_extra_config`: store_dir, cpu_bytes, ..., see docs/connector.md)."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": "minipic.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": dict(options or {})}

# Every key minipic reads from its additional_config section, in one place: the
# span protocol's fields (so a marker added there is allowed here) and the switch.
ENGINE_OPTION_KEYS = frozenset(
    {"enabled", "mask_markers", "prefill_graphs", "recipe", "span_attention", "span_scale",
     "switch_interval_ms", *(field.name for field in dataclasses.fields(SpanProtocol))})

# Span prompts the API server can build from chat `documents` (option `recipe`), the names
# of client.prompts.recipes.RECIPES_BY_NAME (not imported here: the client package is slow
# to import, and this module loads in every engine process).
SERVER_RECIPES = ("epic64", "epic", "epic2", "block_attention")
# The default: answers closest to full prefill on off-the-shelf models (docs/accuracy.md:
# 32 recomputed tokens per document lost 10 points on SmolLM2-135M, 64 lost 2.6).
DEFAULT_SERVER_RECIPE = "epic64"


class UnknownOptionError(ValueError):
    """An additional_config.minipic key minipic does not read."""


def check_option_keys(vllm_config: Any) -> None:
    """Refuse keys of the additional_config section that minipic does not read."""
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get(CONFIG_KEY) if isinstance(additional, Mapping) else None
    if not isinstance(section, Mapping):
        return  # absent, or refused by minipic_options
    unknown = sorted(set(section) - ENGINE_OPTION_KEYS)
    if unknown:
        raise UnknownOptionError(
            f"additional_config.{CONFIG_KEY} has unknown option(s) {', '.join(map(repr, unknown))}; "
            f"minipic reads {', '.join(sorted(ENGINE_OPTION_KEYS))} (connector options such as "
            f"store_dir go in kv_connector_extra_config)")


def minipic_options(vllm_config: Any) -> dict[str, Any] | None:
    """minipic's options for this instance, or None when minipic is off."""
    options: dict[str, Any] | None = None
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is not None and kv.kv_connector == CONNECTOR_NAME:
        options = dict(kv.kv_connector_extra_config or {})
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, Mapping) and CONFIG_KEY in additional:
        section = additional[CONFIG_KEY]
        if section is not None and not isinstance(section, Mapping):
            raise ValueError(f"additional_config.{CONFIG_KEY} must be a dict, got {section!r}")
        options = {**(options or {}), **(section or {})}
    if options is None:
        return None
    enabled = options.get("enabled", True)
    if not isinstance(enabled, bool):  # "false" or 0 must not switch it on
        raise ValueError(f"{CONFIG_KEY}.enabled must be true or false, got {enabled!r}")
    return options if enabled else None


def is_enabled(vllm_config: Any) -> bool:
    return minipic_options(vllm_config) is not None


def span_protocol_of(vllm_config: Any):
    """The instance's span protocol: explicit ids in its options, else its tokenizer's."""
    from minipic.protocol import resolve_span_protocol

    mc = vllm_config.model_config
    return resolve_span_protocol(minipic_options(vllm_config) or {}, mc.tokenizer,
                                 revision=mc.tokenizer_revision,
                                 trust_remote_code=mc.trust_remote_code)


def mask_markers(vllm_config: Any) -> bool:
    """Whether attention hides marker and padding keys (option `mask_markers`)."""
    return _switch(vllm_config, "mask_markers")


def prefill_graphs(vllm_config: Any) -> bool:
    """Whether a span hit's question replays a full CUDA graph (option `prefill_graphs`)."""
    return _switch(vllm_config, "prefill_graphs")


def _switch(vllm_config: Any, option: str) -> bool:
    """A true/false option, false unless given ("yes" or 1 is refused, not read as true)."""
    value = (minipic_options(vllm_config) or {}).get(option, False)
    if not isinstance(value, bool):
        raise ValueError(f"{CONFIG_KEY}.{option} must be true or false, got {value!r}")
    return value


def span_scale(vllm_config: Any) -> float:
    """The weight a query outside spans gives SSep span keys (option `span_scale`)."""
    value = (minipic_options(vllm_config) or {}).get("span_scale", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= 1:
        raise ValueError(f"{CONFIG_KEY}.span_scale must be a number in (0, 1], got {value!r}")
    return float(value)


SPAN_ATTENTION = ("auto", "flash", "triton")


def span_attention(vllm_config: Any) -> str:
    """How CUDA attends span batches (option `span_attention`, see the module docstring)."""
    value = (minipic_options(vllm_config) or {}).get("span_attention", "auto")
    if value not in SPAN_ATTENTION:
        raise ValueError(f"{CONFIG_KEY}.span_attention must be one of "
                         f"{', '.join(map(repr, SPAN_ATTENTION))}, got {value!r}")
    return value


# The GIL's switch interval in minipic's engine processes: a step's host calls wait a
# tenth as long on the input thread as at Python's 5 ms (minipic/switch_interval.py).
DEFAULT_SWITCH_INTERVAL_MS = 0.2
# Python rounds the interval to microseconds: below one it would be 0.
MIN_SWITCH_INTERVAL_MS = 0.001


def switch_interval_ms(vllm_config: Any) -> float | None:
    """Option `switch_interval_ms`: milliseconds (at least MIN_SWITCH_INTERVAL_MS, finite),
    or None for Python's own interval."""
    value = (minipic_options(vllm_config) or {}).get("switch_interval_ms",
                                                     DEFAULT_SWITCH_INTERVAL_MS)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not MIN_SWITCH_INTERVAL_MS <= value < float("inf")):
        raise ValueError(f"{CONFIG_KEY}.switch_interval_ms must be a number of milliseconds "
                         f"from {MIN_SWITCH_INTERVAL_MS} (finite), or null for Python's own, "
                         f"got {value!r}")
    return None if value is None else float(value)


def check_recipe(value: Any, where: str) -> str:
    """One of SERVER_RECIPES; `where` names the option or request field for the message."""
    if value not in SERVER_RECIPES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, SERVER_RECIPES))}, "
                         f"got {value!r}")
    return value


def server_recipe(vllm_config: Any) -> str:
    """The recipe for chat `documents` when a request names none (option `recipe`)."""
    value = (minipic_options(vllm_config) or {}).get("recipe", DEFAULT_SERVER_RECIPE)
    return check_recipe(value, f"{CONFIG_KEY}.recipe")
