"""Router side: score replicas by the spans they hold, from vLLM's KV events.

vLLM publishes BlockStored/BlockRemoved events (`--kv-events-config`); routers
match prefix chains, so minipic's span blocks look like misses to them. Here:
the hashes a prompt's spans have in those events (`span_block_hashes`, computed
by minipic's own engine hasher) and an index of what each replica holds
(`ReplicaIndex`). docs/routing.md explains the rules.
"""

from minipic.routing.replica_index import ReplicaIndex, ReplicaScore, decode_event_batch
from minipic.routing.span_hashes import SpanHashes, prompt_block_hashes, span_block_hashes

__all__ = ["ReplicaIndex", "ReplicaScore", "SpanHashes", "decode_event_batch",
           "prompt_block_hashes", "span_block_hashes"]
