"""A random paged-attention problem in vLLM's Triton layout, and its torch reference.

Shared by the kernel tests (interpreter and GPU) and `tools/bench_kernel.py`.
`k_model` holds K as the model computed it, unrotated: the reference rotates it.
`k_cache` holds K as the span kernel reads it: k_model rotated by its index minus its
SpanLayout.frame_offset (without a layout by its index, as stock vLLM stores it). Link
keys are taken at their index: the backend's cache write turns them back by their
shift too, which the backend tests check; `rotated_k_cache()`
gives every key rotated by its position, so stock kernels can be run on the same
problem.
"""

from __future__ import annotations

import dataclasses

import torch

from minipic.attention.rotation import rotate
from minipic.attention.span_layout import SpanLayout, span_layout, visible_keys
from minipic.protocol import SpanProtocol

# Block kinds in `make_case(markers=...)`: one character per block, what its first token is.
MARKER_TOKENS = {"-": 10, "S": 3, "P": 4, "L": 6}  # plain, SSep, PDep, link
MARKERS = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)


@dataclasses.dataclass
class PagedCase:
    q: torch.Tensor  # [tokens, q_heads, head_size], rotated
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_size], in frames
    v_cache: torch.Tensor
    k_model: torch.Tensor  # like k_cache, unrotated (what the model computed)
    block_table: torch.Tensor  # [seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    seq_lens: torch.Tensor  # [seqs] int32
    query_lens: list[int]
    context_lens: list[int]
    cos_sin: torch.Tensor  # [max_positions, rotary_dim] fp32
    rotary_dim: int
    is_neox: bool
    scale: float
    # Spans and links (span_layout.SpanLayout, [seqs, max_blocks]); None: plain causal.
    layout: SpanLayout | None = None

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens)

    @property
    def max_seqlen_k(self) -> int:
        return max(q + c for q, c in zip(self.query_lens, self.context_lens))

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def pending_new_keys(self, turn: torch.Tensor) -> tuple["NewKeys", list[int]]:
        """The batch's new keys as the model hands them (at their indices; `turn` [tokens]
        turns each back into its frame), as segment_attention takes them for the cache
        write it does first. Their cache slots hold NaN until the write stores them, so a
        read before it shows; the list records each write's token count."""
        from minipic.attention.rotation import Rotation
        from minipic.attention.segment_attention import NewKeys

        slots = self.query_slots()
        stored = self.k_cache[slots]  # in their frames
        model_k = Rotation.at(turn, self.cos_sin, self.rotary_dim, self.is_neox,
                              pure=True).apply(stored).to(stored.dtype)
        self.k_cache[slots] = float("nan")
        written: list[int] = []

        def write(turned: torch.Tensor) -> None:
            written.append(turned.shape[0])
            self.k_cache[slots] = turned

        back = Rotation.back(turn, self.cos_sin, self.rotary_dim, self.is_neox)
        return NewKeys(model_k, back, write), written

    def query_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) in the cache of each query token, in batch order: where the
        batch's new keys are written."""
        device = self.block_table.device
        position = torch.cat([torch.arange(c, c + q, device=device)
                              for q, c in zip(self.query_lens, self.context_lens)])
        request = torch.repeat_interleave(torch.arange(len(self.query_lens), device=device),
                                          torch.tensor(self.query_lens, device=device))
        block = self.block_table[request, position // self.block_size].long()
        return block, position % self.block_size

    def key_positions(self) -> torch.Tensor:
        """Logical position of every cache slot (-1 where no request owns it)."""
        blocks, bs = self.k_cache.shape[:2]
        pos = torch.full((blocks, bs), -1, dtype=torch.long, device=self.k_cache.device)
        slots = torch.arange(bs, device=pos.device)
        for i, seq_len in enumerate(self.seq_lens.tolist()):
            used = -(-seq_len // bs)
            pos[self.block_table[i, :used].long()] = (
                torch.arange(used, device=pos.device)[:, None] * bs + slots)
        return pos

    def key_frame_offsets(self) -> torch.Tensor:
        """Frame offset of every cache slot (SpanLayout.frame_offset; 0 without a layout)."""
        blocks, bs = self.k_cache.shape[:2]
        offsets = torch.zeros(blocks, bs, dtype=torch.long, device=self.k_cache.device)
        if self.layout is None:
            return offsets
        for i, seq_len in enumerate(self.seq_lens.tolist()):
            used = -(-seq_len // bs)
            offsets[self.block_table[i, :used].long()] = \
                self.layout.frame_offset[i, :used].long()[:, None]
        return offsets

    def rotated_k_cache(self, frames: bool = False) -> torch.Tensor:
        """k_model with keys rotated by their positions (the cache stock vLLM would hold),
        or with `frames` by their positions in their frames (minipic's); unowned slots as is."""
        blocks, bs, heads, dim = self.k_model.shape
        pos = self.key_positions().flatten()
        if frames:
            pos = torch.where(pos >= 0, pos - self.key_frame_offsets().flatten(), pos)
        flat = self.k_model.reshape(blocks * bs, heads, dim).clone()
        owned = pos >= 0
        flat[owned] = rotate(flat[owned], pos[owned], self.cos_sin, self.rotary_dim,
                             self.is_neox).to(flat.dtype)
        return flat.reshape(blocks, bs, heads, dim)


def rope_table(rotary_dim: int, max_positions: int, base: float = 10000.0,
               mscale: float = 1.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """vLLM's cos_sin_cache formula in fp32: cat(cos, sin) of position x inv_freq."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * mscale).to(device)


def make_case(query_lens: list[int], context_lens: list[int], *, num_q_heads: int,
              num_kv_heads: int, head_size: int, rotary_dim: int | None = None,
              is_neox: bool = True, dtype: torch.dtype = torch.float16,
              device: str | torch.device = "cpu", block_size: int = 16,
              spare_blocks: int = 3, mscale: float = 1.0, seed: int = 0,
              markers: list[str] | None = None) -> PagedCase:
    """Requests with `context_lens` cached keys then `query_lens` new tokens each.

    Blocks are assigned in random order; unowned slots hold NaN so a kernel that
    reads past a request's keys shows it. `markers`, one string per request, one
    character per block (MARKER_TOKENS: '-' plain, 'S' SSep, 'P' PDep, 'L' link),
    gives the case the SpanLayout minipic's backends compute from such a prompt.
    """
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(per_seq)
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(per_seq):
        block_table[i, :n] = order[taken:taken + n].to(torch.int32)
        taken += n

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = randn(*shape), randn(*shape)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, s in enumerate(seq_lens):
        rows = block_table[i, : per_seq[i]].long()
        owned[rows] = (torch.arange(per_seq[i])[:, None] * block_size
                       + torch.arange(block_size)) < s
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")

    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    max_pos = 2 * max(seq_lens) + 64  # the reference rotates keys up to 2x further (links)
    case = PagedCase(
        q=randn(int(cu[-1]), num_q_heads, head_size).to(device),
        k_cache=k_cache.to(device), v_cache=v_cache.to(device), k_model=k_cache.to(device),
        block_table=block_table.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=list(query_lens), context_lens=list(context_lens),
        cos_sin=rope_table(rotary_dim, max_pos, mscale=mscale, device=device),
        rotary_dim=rotary_dim, is_neox=is_neox, scale=head_size ** -0.5,
        layout=None if markers is None else marker_layout(markers, max_blocks, block_size,
                                                           device),
    )
    case.k_cache = case.rotated_k_cache(frames=True)
    return case


def marker_layout(markers: list[str], min_blocks: int, block_size: int,
                  device: str | torch.device = "cpu") -> SpanLayout:
    """The SpanLayout of requests whose blocks start as `markers` says (see make_case)."""
    width = max(min_blocks, *map(len, markers))
    firsts = [[MARKER_TOKENS[c] for c in row.ljust(width, "-")] for row in markers]
    return span_layout(torch.tensor(firsts), MARKERS, block_size).to(device)


def random_segments(seq_len: int, block_size: int, rng) -> str:
    """A request's blocks as header / SSep spans / PDep blocks (make_case's markers)."""
    kinds = ["-"]
    for _ in range(1, -(-seq_len // block_size)):
        roll = rng.random()
        kinds.append("S" if roll < 0.3 else "P" if roll < 0.4 else "-")
    return "".join(kinds)


def epic_markers(num_docs: int, doc_blocks: int, link_blocks: int, task_blocks: int) -> str:
    """An EPIC prompt's blocks: header, the documents as SSep spans, one link per document
    carrying its first `link_blocks` blocks, then the PDep task."""
    doc = "S" + "-" * (doc_blocks - 1)
    link = "L" + "-" * (link_blocks - 1)
    return "-" + doc * num_docs + link * num_docs + "P" + "-" * (task_blocks - 1)


def shared_documents_case(dtype: torch.dtype, device: str | torch.device = "cpu",
                          seed: int = 0, query_lens=(1, 1, 1), **heads) -> PagedCase:
    """Three EPIC requests: 0 and 2 hold the same two documents (the same keys: 2's span
    blocks copy 0's), 2 one header block later, so the same spans sit at other offsets;
    request 1 other documents. layout.span_id says which blocks hold the same tokens, as
    Model Runner V2's host prompts do (attention/span_identity.py)."""
    markers = [epic_markers(2, 4, 1, 2), epic_markers(3, 3, 1, 2), "-" + epic_markers(2, 4, 1, 2)]
    seq_lens = [16 * len(m) - 5 for m in markers]
    heads = {"num_q_heads": 6, "num_kv_heads": 2, "head_size": 32, **heads}
    case = make_case(list(query_lens), [s - q for s, q in zip(seq_lens, query_lens)],
                     dtype=dtype, device=device, seed=seed, markers=markers, **heads)
    shared_0, shared_2 = case.block_table[0, 1:9].long(), case.block_table[2, 2:10].long()
    case.k_model[shared_2] = case.k_model[shared_0]
    case.v_cache[shared_2] = case.v_cache[shared_0]
    case.k_cache = case.rotated_k_cache(frames=True)
    span_id = torch.full(case.layout.span_of.shape, -1, dtype=torch.int64)
    span_id[0, 1:9] = torch.arange(8)
    span_id[2, 2:10] = torch.arange(8)
    span_id[1, 1:10] = 100 + torch.arange(9)
    assert (case.layout.span_of.cpu()[span_id >= 0] >= 0).all()
    case.layout.span_id = span_id.to(device)
    return case


def reference_attention(case: PagedCase) -> torch.Tensor:
    """Rotate each request's keys by position, then causal attention (or the span and link
    rule of span_layout.visible_keys), in fp32/fp64 torch."""
    bs = case.block_size
    num_q_heads = case.q.shape[1]
    out = torch.empty(case.q.shape, dtype=torch.float64, device=case.q.device)
    starts = case.cu_seqlens_q.tolist()
    for i, (q_len, ctx) in enumerate(zip(case.query_lens, case.context_lens)):
        seq_len = q_len + ctx
        blocks = case.block_table[i, : -(-seq_len // bs)].long()
        k = case.k_model[blocks].flatten(0, 1)[:seq_len]
        v = case.v_cache[blocks].flatten(0, 1)[:seq_len].double()
        pos = torch.arange(seq_len, device=k.device)
        q_pos = ctx + torch.arange(q_len, device=k.device)
        q = case.q[starts[i]: starts[i + 1]].double()
        scores = _scores(q, k, pos, case)
        if case.layout is not None and int(case.layout.link_tokens[i]):
            # Links take no room: a query past them sees the keys before them this much nearer.
            end, room = int(case.layout.links_end[i]), int(case.layout.link_tokens[i])
            near = _scores(q, k, pos + room, case)
            pick = (q_pos[:, None] >= end) & (pos[None, :] < end)
            scores = torch.where(pick[None], near, scores)
        group = num_q_heads // k.shape[1]
        v = v.repeat_interleave(group, 1)
        visible = pos[None, :] <= q_pos[:, None]
        if case.layout is not None:  # the torch backend's rule
            visible = visible_keys(case.layout, i, seq_len, q_len, bs)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, key_pos: torch.Tensor, case: PagedCase
            ) -> torch.Tensor:
    """[heads, queries, keys] scaled scores, the keys rotated to `key_pos` (fp64)."""
    k = rotate(k, key_pos, case.cos_sin, case.rotary_dim, case.is_neox).double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.einsum("qhd,khd->hqk", q, k) * case.scale


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())
