"""An independent Block-Attention reference: HF transformers with an explicit block mask.

Each span (the header, every document) attends only to itself; the task and
generated tokens attend to everything before them. Positions are absolute:
with RoPE a span's internal attention depends only on relative positions, so
this equals "each span prefilled alone at offset 0, then placed".
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


class BlockAttentionReference:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()

    @torch.no_grad()
    def greedy(self, segments: list[list[int]], task: list[int], steps: int
               ) -> tuple[list[int], list[float]]:
        """Greedy tokens and their logprobs after [segments...][task]."""
        tokens = [t for seg in segments for t in seg] + list(task)
        lengths = [len(seg) for seg in segments]
        generated, logprobs = [], []
        for _ in range(steps):
            n = len(tokens)
            allowed = block_mask(lengths, n)
            mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
            logits = self.model(torch.tensor([tokens]), attention_mask=mask,
                                position_ids=torch.arange(n)[None]).logits[0, -1]
            log_probs = logits.log_softmax(-1)
            token = int(log_probs.argmax())
            generated.append(token)
            logprobs.append(float(log_probs[token]))
            tokens.append(token)
        return generated, logprobs
