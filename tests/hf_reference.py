"""Independent references: HF transformers with an explicit mask and position ids.

Block-Attention: each span (the header, every document) attends only to itself;
the task and generated tokens attend to everything before them. Positions are
absolute: with RoPE a span's internal attention depends only on relative
positions, so this equals "each span prefilled alone at offset 0, then placed".

EPIC with links: [header][span 1]..[span N][link 1]..[link N][task]. Link i
carries span i's head; it sits at the positions of that head and attends to the
header and, for every earlier document, its link and the rest of its span. The
task sees the header, every link and every span but the heads the links replace,
and stands right after the last span (links take no room in positions).
"""

from __future__ import annotations

import torch


def block_mask(segment_lengths: list[int], total: int) -> torch.Tensor:
    """Boolean [total, total]: True where query i may attend key j."""
    segment = torch.full((total,), -1)  # -1: attends to everything (task, generated)
    start = 0
    for i, length in enumerate(segment_lengths):
        segment[start : start + length] = i
        start += length
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    same_segment = segment[:, None] == segment[None, :]
    return causal & (same_segment | (segment[:, None] == -1))


def epic_mask_and_positions(header: int, spans: list[int], links: list[int], task: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, n] bool visibility, [n] positions) for the EPIC layout, from segment lengths."""
    n = header + sum(spans) + sum(links) + task
    allowed = torch.zeros(n, n, dtype=torch.bool)
    positions = torch.arange(n)
    span_at = [header + sum(spans[:i]) for i in range(len(spans))]
    link_at = [header + sum(spans) + sum(links[:i]) for i in range(len(links))]

    def see(queries: range, keys: range, causal: bool = False) -> None:
        for q in queries:
            for k in keys:
                allowed[q, k] = not causal or k <= q

    see(range(header), range(header), causal=True)
    for i, length in enumerate(spans):
        own = range(span_at[i], span_at[i] + length)
        see(own, own, causal=True)
    context = [range(header)]  # what a query after the header sees so far
    for i, length in enumerate(links):
        own = range(link_at[i], link_at[i] + length)
        positions[own.start:own.stop] = torch.arange(span_at[i], span_at[i] + length)
        for keys in context:
            see(own, keys)
        see(own, own, causal=True)
        context += [own, range(span_at[i] + length, span_at[i] + spans[i])]
    context += [range(span_at[i], span_at[i] + spans[i]) for i in range(len(links), len(spans))]
    own = range(n - task, n)
    for keys in context:
        see(own, keys)
    see(own, own, causal=True)
    positions[own.start:] -= sum(links)  # links take no room: the task follows the spans
    return allowed, positions


def quiet_taking_no_room(tokens: list[int], allowed: torch.Tensor, positions: torch.Tensor,
                         protocol, own_span: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """minipic's mask_markers on a (mask, positions) layout: marker and padding keys are
    seen by their own query and their own SSep span's queries only (`own_span=False`:
    by their own query only, the option's earlier rule), and take no room: every token
    stands as many positions earlier as there are such tokens at earlier positions among
    what the last token sees (a span head its link replaces is not seen). A span's keys
    keep their distances inside it: its SSep stands one before its first body token."""
    n = len(tokens)
    quiet_ids = protocol.markers | {protocol.pad_token_id}
    quiet = torch.tensor([t in quiet_ids for t in tokens])
    seen = allowed[n - 1].clone()
    seen[n - 1] = True
    hidden_positions = positions[seen & quiet]
    moved = positions - (hidden_positions[None, :] < positions[:, None]).sum(dim=1)
    # Each token's segment: the last marker at or before it; SSep segments are spans,
    # whose tokens keep their distances from their SSep, one before the first body token.
    is_marker = torch.tensor([t in protocol.markers for t in tokens])
    segment = torch.where(is_marker, torch.arange(n), -1).cummax(dim=0).values
    in_span = torch.tensor([s >= 0 and tokens[s] == protocol.ssep_token_id
                            for s in segment.tolist()])
    start = segment.clamp(min=0)
    moved = torch.where(in_span, moved[(start + 1).clamp(max=n - 1)] - 1 + torch.arange(n) - start,
                        moved)
    seen_by = ~quiet[None, :] | torch.eye(n, dtype=torch.bool)
    if own_span:
        seen_by |= in_span[:, None] & (segment[:, None] == segment[None, :])
    return allowed & seen_by, moved


class BlockAttentionReference:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()

    def greedy(self, segments: list[list[int]], task: list[int], steps: int
               ) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs after [segments...][task]."""
        tokens = [t for seg in segments for t in seg] + list(task)
        allowed = block_mask([len(seg) for seg in segments], len(tokens))
        return self.greedy_masked(tokens, allowed, torch.arange(len(tokens)), steps)

    @torch.no_grad()
    def greedy_masked(self, tokens: list[int], allowed: torch.Tensor, positions: torch.Tensor,
                      steps: int, bias: torch.Tensor | None = None
                      ) -> tuple[list[int], list[float]]:
        """Greedy decoding over a prompt with visibility `allowed` [n, n] and `positions` [n]
        (and `bias` [n, n] added to the scores of the keys seen, if given).

        Each generated token sees what the last prompt token sees, and itself; it
        sits one position after the last prompt token."""
        tokens, generated, logprobs = list(tokens), [], []
        bias = torch.zeros(allowed.shape) if bias is None else bias
        for _ in range(steps):
            n = len(tokens)
            mask = bias.masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
            logits = self.model(torch.tensor([tokens]), attention_mask=mask,
                                position_ids=positions[None]).logits[0, -1]
            log_probs = logits.log_softmax(-1)
            token = int(log_probs.argmax())
            generated.append(token)
            logprobs.append(float(log_probs[token]))
            tokens.append(token)
            allowed = _extend(allowed, True)
            bias = _extend(bias, 0.0)
            positions = torch.cat((positions, positions[-1:] + 1))
        return generated, logprobs


def _extend(table: torch.Tensor, own) -> torch.Tensor:
    """One more token, which sees what the last one sees (its row of the [n, n] table, a
    visibility or a bias, copied) and itself (`own`)."""
    n = table.shape[0]
    grown = torch.zeros(n + 1, n + 1, dtype=table.dtype)
    grown[:n, :n] = table
    grown[n, :n] = table[n - 1]
    grown[n, n] = own
    return grown
