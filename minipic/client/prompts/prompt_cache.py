"""Prompt Cache recipe: named modules, prefilled once, reused in any order.

Each module is an SSep span, so its blocks hash the same at any offset. A
prompt is any sequence of module names and free text. Free text is never
cached: it is [PDep + text], so its blocks hash over everything before it, and
it is padded when a module follows so that the module's SSep starts a block.
With a BOS-bearing tokenizer the prompt starts with a [BOS + pad] header block,
itself a prefill request, so that BOS sits at position 0 yet block 0 still hits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from minipic.client.prompts.span_prompt import (
    SpanPrompt, SpanPromptError, TextOrTokens, bos_of, check_block_size, check_body,
    make_header, make_task, pad_to_block, span_from, to_tokens,
)
from minipic.protocol import SpanProtocol


@dataclasses.dataclass(frozen=True)
class Text:
    """Free text (or token ids) in a prompt; a plain str part names a module."""

    content: TextOrTokens


class PromptCache:
    def __init__(self, modules: Mapping[str, TextOrTokens], *, protocol: SpanProtocol,
                 block_size: int, tokenizer: Any = None):
        self.protocol = protocol
        self.block_size = check_block_size(block_size)
        self.tokenizer = tokenizer
        self.header = make_header([], bos_of(tokenizer), protocol, self.block_size)
        self.modules: dict[str, list[int]] = {}
        for name, module in modules.items():
            self.add(name, module)

    def add(self, name: str, module: TextOrTokens) -> None:
        """Register a module: text, token ids, or a pre-built span."""
        if not isinstance(name, str) or not name:
            raise SpanPromptError(f"module names must be non-empty strings, got {name!r}")
        span = span_from(module, self.protocol, self.block_size, self.tokenizer,
                         f"module {name!r}")
        if self.modules.get(name, span) != span:
            raise SpanPromptError(f"module {name!r} is already registered with other content")
        self.modules[name] = span

    @property
    def span_prefills(self) -> list[list[int]]:
        """Every module (and the header): prefill these once, up front."""
        return ([self.header] if self.header else []) + list(self.modules.values())

    def prompt(self, *parts: str | Text | Sequence[int]) -> SpanPrompt:
        """Module names (str) and free text (Text(...) or token ids), in any order."""
        segments = self._segments(parts)
        if not segments:
            raise SpanPromptError("a prompt needs at least one module or non-empty text")
        final = list(self.header)
        prefills = [self.header] if self.header else []
        for i, segment in enumerate(segments):
            if isinstance(segment, str):
                final += self.modules[segment]
                prefills.append(self.modules[segment])
            elif i + 1 < len(segments):  # a module follows: its SSep must start a block
                final += pad_to_block(segment, self.block_size, self.protocol.pad_token_id)
            else:
                final += segment
        return SpanPrompt.build(prefills, final, self.protocol, self.block_size)

    def _segments(self, parts: Sequence[Any]) -> list[str | list[int]]:
        """Module names as is, free parts as [PDep + tokens]; adjacent free parts merge."""
        segments: list[str | list[int]] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                segments.append(self._module_name(part, i))
                continue
            where = f"free text (part {i})"
            content = part.content if isinstance(part, Text) else part
            tokens = to_tokens(content, self.tokenizer, where)
            check_body(tokens, self.protocol, where)
            if not tokens:
                continue
            if segments and not isinstance(segments[-1], str):
                segments[-1] += tokens  # one PDep per run of free text is enough
            else:
                segments.append(make_task(tokens, self.protocol, where))
        return segments

    def _module_name(self, name: str, index: int) -> str:
        if name not in self.modules:
            raise SpanPromptError(
                f"part {index}: unknown module {name!r} (registered: {sorted(self.modules)}); "
                "wrap free text in Text(...)"
            )
        return name
