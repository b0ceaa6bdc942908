"""Worker side: the span layout and link blocks, i.e. which keys each query may attend to.

An SSep block's hash says "my KV depends only on the tokens from my span's
SSep block on". Attention makes that true: a query inside an SSep span sees
keys from the span's first block only; a query after PDep, or with no marker
before it, sees everything before it (stock causal attention). So a span
computed inside a final prompt (because it missed) gets exactly the KV it
would get prefilled alone, and whatever lands in the cache under an SSep hash
is honest, whatever order requests come in.

EPIC link blocks (minipic.client.prompts.recipes.epic): the k-th link segment carries the
first block(s) of the k-th span again, computed in context at that span's logical
positions; every query outside spans then sees the link in place of the span's
own (solo) head. See `SpanLayout` for the rules.

Attention metadata carries no token ids, so the marker blocks are read from
the model runner's own per-request token table:
  * V1 runner (CPU, and CUDA with VLLM_USE_V2_MODEL_RUNNER=0):
    `input_batch.token_ids_cpu_tensor`, row i = request i of the batch;
  * Model Runner V2 (CUDA default on vLLM 0.25): a host copy of each prompt, kept
    when the runner adds its request (host_prompts.py), rows picked by the batch's
    `idx_mapping_np`. Its own table, `req_states.all_token_ids.gpu`, lives on the GPU:
    reading it back would wait for the GPU every step and undo vLLM's asynchronous
    scheduling (a 256-request decode step 50 -> 38 ms on an H200). Only mask_markers,
    whose quiet keys include generated tokens, still reads it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from typing import Any, Callable

import numpy as np
import torch

from minipic.attention.host_copy import to_device_together
from minipic.attention.span_identity import NO_ID
from minipic.protocol import SpanProtocol


def _no_runner() -> Any:
    return None


_runner: Callable[[], Any] = _no_runner  # a weak reference to the registered runner
_protocol: SpanProtocol | None = None
_mask_markers = False  # hide marker and padding keys (minipic option mask_markers)
_span_scale = 1.0  # the weight outside queries give span keys (minipic option span_scale)
_mrv2_idx_mapping: torch.Tensor | None = None  # rows of the batch being run (MRV2)
_mrv2_idx_mapping_np = None  # the same rows on the host (numpy)
_last_host_layout: tuple | None = None  # (what it was built from, SpanLayout): _host_layout
# A host layout's width in blocks is a multiple of this (_host_layout).
HOST_LAYOUT_BLOCK_STEP = 32


class OneEnginePerProcessError(RuntimeError):
    """A second minipic engine in a process that still runs one."""


def register_runner(runner: Any, protocol: SpanProtocol, mask_markers: bool = False,
                    span_scale: float = 1.0) -> None:
    """Called when minipic's worker builds its model runner (see _vllm_patches).

    The runner and the rope (attention.rope) are per process: a second live minipic
    engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) would make the first one
    read the second one's tokens and rope. Refused; held weakly, so an engine that
    was shut down does not count."""
    global _runner, _protocol
    previous = _runner()
    if previous is not None and previous is not runner:
        gc.collect()  # shut down but not yet collected is not alive
        if _runner() is not None:
            raise OneEnginePerProcessError(
                "minipic serves one engine per process, and this process runs one already: "
                "shut it down first, or keep vLLM's engine processes "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=1, the default)")
    global _mask_markers, _span_scale
    _runner, _protocol, _mask_markers = weakref.ref(runner), protocol, mask_markers
    _span_scale = span_scale


def current_protocol() -> SpanProtocol | None:
    """The registered engine's markers (register_runner)."""
    return _protocol


def current_span_scale() -> float:
    """The registered engine's span_scale (register_runner; 1 without an engine)."""
    return _span_scale


def note_mrv2_batch(idx_mapping: torch.Tensor, idx_mapping_np=None) -> None:
    """Model Runner V2 prepared a batch: remember which token rows it runs."""
    global _mrv2_idx_mapping, _mrv2_idx_mapping_np
    _mrv2_idx_mapping, _mrv2_idx_mapping_np = idx_mapping, idx_mapping_np


# A block no context query may see (a span head replaced by its link), as a
# logical position past any sequence.
HIDDEN = 1 << 30


@dataclasses.dataclass
class SpanLayout:
    """Per (request, block) of a batch, what attention needs to know; int32 [reqs, blocks].

    span_of[r, b]      the block index of the SSep block starting b's span, -1 when
                       b is not inside an SSep span (header, PDep task, link, plain):
                       a query in a span sees keys of its own span only.
    context_pos[r, b]  the logical position of b's first token as a query outside
                       spans sees it: b * block_size, except that a link block takes
                       the position of the span block it carries, and that span
                       block is HIDDEN. Such a query sees keys at logical positions
                       up to its own (and never keys after it in the sequence).
    shift[r, b]        physical minus logical position of b's tokens: non-zero for
                       link blocks only. Their Q is turned back by it.
    frame_offset[r, b] where the frame b's keys are stored in starts: the first token
                       of its SSep span for span blocks (so a span's keys are the same
                       wherever it sits), link_tokens for blocks past the links (they
                       are stored at their logical positions), 0 elsewhere. The model
                       hands attention K rotated at its index; the KV cache write turns
                       it back by frame_offset + shift, and attention turns stored keys
                       forward by frame_offset: plain prompts are stored as stock vLLM
                       stores them.
    links_end[r]       the token index where request r's last link block ends (0: no
                       links), and
    link_tokens[r]     how many link tokens its prompt holds. Links take no room: a
                       query at or past links_end stands link_tokens positions earlier
                       than its index, so the task sits right after the last document
                       as in the plain prompt (docs/accuracy.md measures the difference).
                       Its keys before links_end are seen link_tokens positions nearer;
                       the keys at or past it keep their distances.
    """

    span_of: torch.Tensor
    context_pos: torch.Tensor
    shift: torch.Tensor
    frame_offset: torch.Tensor
    links_end: torch.Tensor | None = None  # [reqs] int32; None: zeros (no links)
    link_tokens: torch.Tensor | None = None
    # With mask_markers only, [reqs, tokens]: marker and padding keys, which no query
    # outside their own span sees (quiet), and where every token stands when markers and
    # padding take no room (logical, see logical_positions); [reqs, blocks]: how far
    # each block's stored keys are turned forward when read (read_offset; None: by
    # frame_offset).
    quiet: torch.Tensor | None = None
    logical: torch.Tensor | None = None
    read_offset: torch.Tensor | None = None
    # [reqs, blocks] int64, Model Runner V2 only: an id of b's span (all its tokens) and
    # b's place in it (span_identity.py; -1 outside spans and in a span at its prompt's
    # end): blocks of one id hold the same keys in the same frame, so requests sharing a
    # document read it once (segment_plan.py). None: not known, nothing shared.
    span_id: torch.Tensor | None = None
    # What plans derive from this layout object (segment_plan.py): a decode step over the
    # same requests gets the last step's layout object, so its plan starts from the last
    # one. Not copied by dataclasses.replace (init=False): another layout derives anew.
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        rows = self.span_of.shape[0]
        for name in ("links_end", "link_tokens"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(rows, dtype=torch.int32,
                                                device=self.span_of.device))

    def to(self, device: torch.device | str) -> "SpanLayout":
        """The layout on `device`: itself when it is there already (a plan's tables of it
        are then kept, segment_plan._layout_tables)."""
        tables = (self.span_of, self.context_pos, self.shift, self.frame_offset,
                  self.links_end, self.link_tokens, self.quiet, self.logical,
                  self.read_offset, self.span_id)
        if all(t is None or t.device == torch.device(device) for t in tables):
            return self
        present = [t for t in tables if t is not None]  # one copy per dtype
        moved = iter(to_device_together(present, device))
        return SpanLayout(*[None if t is None else next(moved) for t in tables])

    def has_links(self) -> bool:
        return bool(self.shift.any())

    def is_plain(self) -> bool:
        """Stock causal attention over keys at their positions: no links, no span but at
        a prompt's start (a span prefilled alone), and no quiet key where a query outside
        spans could see it. A query in such a span sees every key before it, its marker
        included, and its frame is the prompt's: stock attention gives it exactly its
        span's KV.

        Asked once per layout object (a decode step reuses the last step's layout, and a
        reduction over the whole table costs the step's host time): a layout is complete
        when current_layout returns it and is not changed after."""
        plain = self.derived.get("is_plain")
        if plain is None:
            plain = self.derived["is_plain"] = (
                not bool(self.frame_offset.any()) and not self.has_links()
                and not self._quiet_outside_spans())
        return plain

    def _quiet_outside_spans(self) -> bool:
        """Some request has quiet keys and a block outside spans (mask_markers)."""
        if self.quiet is None:
            return False
        has_quiet = self.quiet.any(dim=1).to(self.span_of.device)
        return bool((has_quiet & (self.span_of < 0).any(dim=1)).any())


def span_layout(block_first_tokens: torch.Tensor, protocol: SpanProtocol, block_size: int,
                prompt_lens: torch.Tensor | None = None) -> SpanLayout:
    """[reqs, blocks] first tokens -> the batch's SpanLayout.

    Markers count in the prompt only (`prompt_lens` [reqs]), as in the block hasher.
    The k-th link segment (a link block and the plain blocks after it) stands for
    the first blocks of the k-th SSep span. The front end refuses every prompt where
    that would not hold (protocol.check_links: the span missing or shorter, a PDep
    block between a span and its link); this function assumes it does.
    """
    firsts = block_first_tokens
    num_reqs, num_blocks = firsts.shape
    block = torch.arange(num_blocks, device=firsts.device).expand(num_reqs, -1)
    in_prompt = torch.ones_like(firsts, dtype=torch.bool)
    if prompt_lens is not None:
        in_prompt = block * block_size < prompt_lens.to(firsts.device)[:, None]
    is_ssep = (firsts == protocol.ssep_token_id) & in_prompt
    is_link = torch.zeros_like(is_ssep)
    if protocol.link_token_id is not None:
        is_link = (firsts == protocol.link_token_id) & in_prompt
    is_marker = is_ssep | is_link | ((firsts == protocol.pdep_token_id) & in_prompt)
    # The last marker block at or before each block (-1: none yet).
    last = torch.where(is_marker, block, -1).cummax(dim=1).values
    opened = last >= 0
    last_index = last.clamp(min=0)
    in_span = is_ssep.gather(1, last_index) & opened
    # Prompt blocks only: past a prompt that ends inside its links (a batch row is as wide as
    # its longest request) a block is no link, and must not hide the span block it would carry.
    in_link = is_link.gather(1, last_index) & opened & in_prompt
    span_of = torch.where(in_span, last, -1)
    carried = _carried_span_block(block, last_index, is_ssep, is_link, in_link)
    context_block = torch.where(in_link, carried, block)
    hidden = torch.zeros(num_reqs, num_blocks + 1, dtype=torch.bool, device=firsts.device)
    hidden.scatter_(1, torch.where(in_link, carried, num_blocks), True)
    context_pos = torch.where(hidden[:, :num_blocks], HIDDEN, context_block * block_size)
    # in_link holds prompt blocks only: a prompt may end inside its links (then no query is
    # past them). The front end allows one run of links (protocol.check_links), so this is
    # its length.
    links_end = (torch.where(in_link, block + 1, 0).amax(dim=1) * block_size).to(torch.int32)
    link_tokens = (in_link.sum(dim=1) * block_size).to(torch.int32)
    past_links = (block * block_size >= links_end[:, None]) & (links_end[:, None] > 0)
    frame_offset = torch.where(in_span, span_of * block_size,
                               torch.where(past_links, link_tokens[:, None], 0))
    return SpanLayout(span_of.to(torch.int32), context_pos.to(torch.int32),
                      ((block - context_block) * block_size).to(torch.int32),
                      frame_offset.to(torch.int32), links_end, link_tokens)


def _carried_span_block(block, last_index, is_ssep, is_link, in_link) -> torch.Tensor:
    """For blocks of the k-th link segment, the block of the k-th span they carry."""
    num_reqs, num_blocks = block.shape
    span_ordinal = is_ssep.cumsum(dim=1)  # 1 for the first span's SSep block, ...
    first_block_of_span = torch.full((num_reqs, num_blocks + 1), num_blocks, device=block.device)
    first_block_of_span.scatter_(1, torch.where(is_ssep, span_ordinal, 0),
                                 torch.where(is_ssep, block, num_blocks))
    link_ordinal = is_link.cumsum(dim=1).gather(1, last_index)
    carried = first_block_of_span.gather(1, link_ordinal.clamp(max=num_blocks)) + block - last_index
    return torch.where(in_link, carried.clamp(max=num_blocks), block)


def _token_rows(num_reqs: int, width: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's token-id rows [reqs, width or max_model_len] (prompt and output), and
    prompt lengths."""
    runner = _runner()
    if runner is None:
        return None
    if hasattr(runner, "req_states"):  # Model Runner V2
        if _mrv2_idx_mapping is None:
            return None  # dummy / capture runs before any real batch
        rows = _mrv2_idx_mapping[:num_reqs].long()
        states = runner.req_states
        # prompt_len, not prefill_len: after a preemption prefill_len includes generated
        # tokens, which never start a span (the hasher counts prompt tokens only).
        return states.all_token_ids.gpu[rows, :width], states.prompt_len.gpu[rows]
    batch = runner.input_batch
    return (batch.token_ids_cpu_tensor[:num_reqs, :width],
            torch.from_numpy(batch.num_prompt_tokens[:num_reqs]))


def quiet_keys(tokens: torch.Tensor, protocol: SpanProtocol) -> torch.Tensor:
    """[reqs, tokens] bool: marker and padding tokens, generated ones too, so that a
    block's KV depends on its tokens only, as its hash does."""
    ids = torch.tensor(sorted(protocol.markers | {protocol.pad_token_id}), device=tokens.device)
    return torch.isin(tokens, ids)


def current_layout(num_reqs: int, block_size: int, max_seq_len: int | None = None,
                   decoding: np.ndarray | None = None) -> SpanLayout | None:
    """The SpanLayout of the batch being built; None if unknown (dummy runs).

    `max_seq_len`: the batch's longest sequence (or a bound on it). The runner's token
    rows are max_model_len wide; the layout needs the batch's blocks only (mask_markers'
    per token tables would otherwise cost max_model_len per request, every step).
    `decoding` [num_reqs] bool: the rows whose query is one token this step, the only ones
    given span ids (None: every row). Reading a shared document once saves a decode row
    its keys, which are its whole cost; a longer query's cost is its copies, one per
    document (the ISPS final-prompt step took 3.01 ms a layer with its documents shared,
    2.89 without, docs/attention.md). A prompt's ids cost hashing all its spans on the
    step's host time: now at its first decode step, and never for a request that ends at
    its prefill (a one-token answer, ISPS's final prompts).
    On the host, but for Model Runner V2 with mask_markers (whose quiet keys include
    generated tokens, which only the GPU's table holds)."""
    width = None if max_seq_len is None else -(-max_seq_len // block_size) * block_size
    if not _mask_markers:
        layout = _host_layout(num_reqs, block_size, width, decoding)
        if layout is not None:
            return layout
    found = _token_rows(num_reqs, width)
    if found is None:
        return None
    tokens, prompt_lens = found
    layout = span_layout(tokens[:, ::block_size], _protocol, block_size, prompt_lens)
    if _mask_markers:
        take_no_room(layout, quiet_keys(tokens, _protocol), block_size)
    return layout


def _host_layout(num_reqs: int, block_size: int, width: int | None,
                 decoding: np.ndarray | None = None) -> SpanLayout | None:
    """MRV2: the batch's layout from the runner's host copy of its prompts
    (attention.host_prompts); None on the V1 runner (its table is on the host already) and
    before the first real batch. The layout depends on the prompts and the batch's width
    (rounded up to HOST_LAYOUT_BLOCK_STEP blocks) only, so a decode step whose batch holds
    the same requests as the last step's reuses that layout (and the plan's tables of it):
    it is not changed after it is built."""
    runner = _runner()
    prompts = getattr(runner, "minipic_host_prompts", None)
    if prompts is None or _mrv2_idx_mapping_np is None or width is None:
        return None
    return host_layout(prompts, _mrv2_idx_mapping_np[:num_reqs], block_size, width, decoding)


def host_layout(prompts, rows: np.ndarray, block_size: int, width: int,
                decoding: np.ndarray | None = None) -> SpanLayout | None:
    """The layout of the batch of runner rows `rows` (int32) from minipic's host copy of
    their prompts, as _host_layout makes it (the full-graph dispatch check makes it before
    the batch is built: the builder's current_layout finds it made)."""
    global _last_host_layout
    # Decoding sequences cross a block every block_size steps: a layout some blocks wider
    # than the batch needs serves the steps after it too (the plan steps on over it).
    blocks = -(-width // (block_size * HOST_LAYOUT_BLOCK_STEP)) * HOST_LAYOUT_BLOCK_STEP
    # one request shares with no one: its spans' ids are not worth their hashing
    share = (rows.size > 1) & (np.ones(rows.size, dtype=bool) if decoding is None
                               else np.asarray(decoding[: rows.size], dtype=bool))
    key = (prompts, prompts.generation, rows.tobytes(), block_size, blocks, share.tobytes())
    if _last_host_layout is not None and _last_host_layout[0] == key:
        return _last_host_layout[1]
    if not prompts.holds(rows):
        return None  # not a batch of running requests (a dummy run): the runner's table
    firsts, span_ids, prompt_lens = prompts.blocks(rows, block_size, blocks, span_ids=share)
    layout = span_layout(torch.from_numpy(firsts), _protocol, block_size,
                         torch.from_numpy(prompt_lens))
    if span_ids is not None:
        layout.span_id = torch.where(layout.span_of >= 0, torch.from_numpy(span_ids), NO_ID)
    _last_host_layout = (key, layout)
    return layout


def take_no_room(layout: SpanLayout, quiet: torch.Tensor, block_size: int) -> None:
    """mask_markers: marker and padding keys hidden from every query outside their own
    span, and taking no room. Every token stands as many positions earlier as there are
    quiet tokens before it in the sequence the task sees (layout.logical); a span's keys,
    kept in its frame, are turned forward to where its first body token stands, less one
    for its SSep (layout.read_offset), and inside a span its tokens keep their distances.
    Links take no room through the same positions, so the torch backend's second score
    for keys before the links is not needed."""
    layout.quiet = quiet
    logical = logical_positions(layout, quiet, block_size)
    starts = (layout.span_of.clamp(min=0) * block_size + 1).long()
    body = logical.gather(1, starts.clamp(max=quiet.shape[1] - 1))
    layout.read_offset = torch.where(layout.span_of >= 0, body - 1, 0).to(torch.int32)
    # Inside a span every token stands where its key is read: at its distance from its
    # SSep, as when the span is prefilled alone (its queries see their SSep and padding).
    index = torch.arange(quiet.shape[1], device=logical.device).expand_as(logical)
    block = index // block_size
    span_start = layout.span_of.gather(1, block) * block_size
    layout.logical = torch.where(span_start >= 0,
                                 layout.read_offset.gather(1, block) + index - span_start,
                                 logical).to(torch.int32)


def logical_positions(layout: SpanLayout, quiet: torch.Tensor, block_size: int) -> torch.Tensor:
    """[reqs, tokens]: each token's position when quiet tokens take no room.

    Starts from the positions the layout gives (a link token at the head it carries, a
    token past the links link_tokens earlier) and subtracts the quiet tokens at earlier
    positions among those the task sees (a span head replaced by its link is not seen;
    it stands where its link stands, so it counts as its link does)."""
    reqs, n = quiet.shape
    index = torch.arange(n, device=quiet.device).expand(reqs, -1)
    block = index // block_size
    in_span = layout.span_of.gather(1, block) >= 0
    past_links = (index >= layout.links_end[:, None]) & ~in_span \
        & (layout.links_end[:, None] > 0)
    base = index - layout.shift.gather(1, block) \
        - torch.where(past_links, layout.link_tokens[:, None], 0)
    seen = layout.context_pos.gather(1, block) != HIDDEN
    # How many counted (seen, quiet) tokens stand at each position, then before each token's
    # position: one scatter and one running sum for the whole batch (no per-request loop,
    # which would be thousands of small launches a step on a GPU).
    counted_at = torch.zeros(reqs, n + 1, dtype=torch.int64, device=quiet.device)
    counted_at.scatter_add_(1, base.clamp(0, n), (seen & quiet).to(torch.int64))
    before = counted_at.cumsum(dim=1) - counted_at
    return (base - before.gather(1, base.clamp(0, n))).to(torch.int32)


def per_query_token(table: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    block_size: int) -> torch.Tensor:
    """Per query token of the batch, its block's entry of a [reqs, blocks] table.

    A request's query tokens are the last ones of its sequence. One gather for the
    whole batch: a step may hold a thousand requests. A host table is gathered in numpy
    (single-threaded: torch's small host ops each wake its thread pool, and the
    builder runs them every step)."""
    if table.device.type == "cpu":
        starts = np.asarray(query_start_loc[: len(seq_lens) + 1])
        num_queries = np.diff(starts)
        request = np.repeat(np.arange(len(seq_lens)), num_queries)
        position = (np.asarray(seq_lens) - num_queries)[request] \
            + np.arange(request.size) - starts[:-1][request]
        return torch.from_numpy(table.numpy()[request, position // block_size])
    device = table.device
    starts = torch.tensor(query_start_loc[: len(seq_lens) + 1], device=device)
    num_queries = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), num_queries)
    first_position = torch.tensor(seq_lens, device=device) - num_queries
    position = first_position[request] + torch.arange(request.shape[0], device=device) \
        - starts[:-1][request]
    return table[request, position // block_size]


def token_shifts(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                 block_size: int) -> torch.Tensor | None:
    """Per token of the batch, how far its Q is turned back: its link shift (see
    SpanLayout), or with mask_markers to its logical position; None when all are 0."""
    if layout.logical is not None:
        return _per_token_turn(_index(layout.logical) - layout.logical, query_start_loc,
                               seq_lens)
    return _nonzero(per_query_token(layout.shift, query_start_loc, seq_lens, block_size))


def key_turn_backs(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                   block_size: int) -> torch.Tensor | None:
    """Per token of the batch, how far its K is turned back before the cache write
    (frame_offset + shift, see SpanLayout; with mask_markers a key outside spans goes to
    its logical position); None when all are 0."""
    if layout.logical is not None:
        index = _index(layout.logical)
        block = index // block_size
        turn = torch.where(layout.span_of.gather(1, block) >= 0,
                           layout.frame_offset.gather(1, block), index - layout.logical)
        return _per_token_turn(turn, query_start_loc, seq_lens)
    # The batch's own tokens decide, not the table: a task after cached spans has spans
    # turned in the table but nothing to turn itself (every layer would rotate by 0).
    turn = layout.derived.get("key_turn")
    if turn is None:  # once per layout object, as is_plain
        turn = layout.derived["key_turn"] = layout.frame_offset + layout.shift
    return _nonzero(per_query_token(turn, query_start_loc, seq_lens, block_size))


def _index(per_token: torch.Tensor) -> torch.Tensor:
    return torch.arange(per_token.shape[1], device=per_token.device).expand_as(per_token)


def _per_token_turn(turn: torch.Tensor, query_start_loc: list[int],
                    seq_lens: list[int]) -> torch.Tensor | None:
    return _nonzero(per_query_token(turn, query_start_loc, seq_lens, 1))


def _nonzero(turns: torch.Tensor) -> torch.Tensor | None:
    """`turns`, or None when all are 0: the layers then skip the rotation. One host
    read (a device sync under Model Runner V2, whose token rows live on the GPU) saves
    a rotation in every layer."""
    return turns if bool(turns.any()) else None


def key_frame_offsets(layout: SpanLayout, row: int, seq_len: int, block_size: int) -> torch.Tensor:
    """[seq_len]: how far request `row`'s stored keys are turned forward when read."""
    table = layout.frame_offset if layout.read_offset is None else layout.read_offset
    key_block = torch.arange(seq_len, device=table.device) // block_size
    return table[row, key_block]


def span_key_bias(layout: SpanLayout, row: int, seq_len: int, num_queries: int,
                  block_size: int, scale: float) -> torch.Tensor:
    """[num_queries, seq_len] float: log(scale) where a query outside spans meets a key
    inside an SSep span, 0 elsewhere; added to the scores, it gives each such key `scale`
    times its weight (APE's scale: those keys were computed alone). Link blocks are
    outside spans: their keys were computed in context."""
    key_block = torch.arange(seq_len, device=layout.span_of.device) // block_size
    in_span = layout.span_of[row, key_block] >= 0
    outside = ~in_span[seq_len - num_queries:]
    pairs = outside[:, None] & in_span[None, :]
    return torch.where(pairs, math.log(scale), 0.0)


def visible_keys(layout: SpanLayout, row: int, seq_len: int, num_queries: int,
                 block_size: int) -> torch.Tensor:
    """[num_queries, seq_len] bool: which keys each query token of request `row` sees.

    The rules of SpanLayout, spelled out for the torch backend (the Triton kernel
    applies the same per tile)."""
    device = layout.span_of.device
    key_pos = torch.arange(seq_len, device=device)
    key_block, offset = key_pos // block_size, key_pos % block_size
    span = layout.span_of[row, key_block]
    context = layout.context_pos[row, key_block] + offset
    q = slice(seq_len - num_queries, seq_len)
    q_span, q_context = span[q, None], context[q, None]
    same_span = span[None, :] == q_span
    visible = torch.where(q_span >= 0, same_span, context[None, :] <= q_context)
    if layout.quiet is not None:
        # A quiet key is seen by its own query and its own span's (a span's marker is the
        # sink its tokens attended to when it was prefilled alone), by nothing after it.
        quiet = layout.quiet[row, :seq_len].to(device)[None, :]
        visible &= ~quiet | (key_pos[None, :] == key_pos[q, None]) | (q_span >= 0)
    return visible & (key_pos[None, :] <= key_pos[q, None])
