"""MiniPICConnector: vLLM's OffloadingConnector, pointed at a minipic span store.

    --kv-transfer-config '{"kv_connector": "MiniPICConnector",
                           "kv_connector_module_path": "minipic.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store_dir": "/data/spans"}}'

Naming this connector also switches minipic on (SSep/PDep hashing, span keys
stored in their span's frame: see minipic.config), so every block it moves is
position-free and
keyed by a hash that ignores where its span sits. What this class adds to
vLLM's connector is small:

  * options -> vLLM's offload config (options.py), and checks that fail at
    start-up instead of silently storing nothing;
  * the store namespace, computed once from vLLM's config and handed to the
    disk tier (scheduler/identity.py, scheduler/disk_tier.py);
  * span heads: which blocks start with SSep, for `minipic store stats`.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from minipic.connector.options import ConnectorConfigError, apply_offload_config
from minipic.connector.scheduler.cpu_tier_sizing import warn_if_cpu_tier_small
from minipic.connector.scheduler.span_heads import SpanHeads, span_head_keys


def check_engine_config(vllm_config: Any) -> None:
    """Configurations under which the store would be wrong or silently never hit."""
    from minipic.config import is_enabled

    if not is_enabled(vllm_config):
        raise ConnectorConfigError(
            "MiniPICConnector stores position-free KV: minipic cannot be switched off "
            "(\"enabled\": false) while this connector is in use")
    if vllm_config.lora_config is not None:
        raise ConnectorConfigError(
            "MiniPICConnector with LoRA is not supported: block hashes key adapters by name, "
            "so a changed adapter could be served stale KV from the persistent store")
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        raise ConnectorConfigError(
            "MiniPICConnector keys spans by prefix-cache block hashes: "
            "turn prefix caching on (remove --no-enable-prefix-caching)")
    from minipic.hashing.block_hasher import check_hash_algo

    check_hash_algo(cache.prefix_caching_hash_algo)


def check_minipic_active(role: KVConnectorRole) -> None:
    """minipic's plugin must have patched this process, or the store would get
    stock hashes (scheduler) or span keys outside their frames (worker) under
    minipic's namespace.
    It marks each wrapper with `__minipic_original__` (minipic/_vllm_patches.py)."""
    if role == KVConnectorRole.SCHEDULER:
        from vllm.v1.core import kv_cache_utils as module

        patched = module.get_request_block_hasher
    else:
        from vllm.v1.attention import selector as module

        patched = module.get_attn_backend
    if getattr(patched, "__minipic_original__", None) is None:
        raise ConnectorConfigError(
            "MiniPICConnector needs minipic's vLLM plugin in every vLLM process; it is not "
            "loaded here (is minipic installed in this environment, and 'minipic' in "
            "VLLM_PLUGINS if you set it?)")


class MiniPICConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        apply_offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        check_minipic_active(role)
        check_engine_config(vllm_config)  # both roles: workers must store span frames
        super().__init__(vllm_config, role, kv_cache_config)
        self._span_heads: SpanHeads | None = None
        if self.connector_scheduler is not None:
            self._open_store(vllm_config, kv_cache_config)

    def _open_store(self, vllm_config: Any, kv_cache_config: Any) -> None:
        from minipic.connector.scheduler.disk_tier import MiniPICDiskTier
        from minipic.connector.scheduler.identity import engine_namespace_fields
        from minipic.config import span_protocol_of

        protocol = span_protocol_of(vllm_config)
        self._ssep_token_id = protocol.ssep_token_id
        self._hash_block_size = vllm_config.cache_config.block_size
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        tiers = [t for t in getattr(self.connector_scheduler.manager, "secondary_tiers", ())
                 if isinstance(t, MiniPICDiskTier)]
        if not tiers:
            return
        self._span_heads = SpanHeads()
        fields = engine_namespace_fields(vllm_config, kv_cache_config, protocol, type(self))
        for tier in tiers:
            tier.open(fields, self._span_heads)
        warn_if_cpu_tier_small(
            tier_bytes=tiers[0].primary_bytes, block_bytes=tiers[0].block_bytes,
            block_size=self._hash_block_size,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens)

    def on_new_request(self, request: Any) -> None:
        if self._span_heads is not None:
            self._span_heads.add(span_head_keys(
                request.all_token_ids, request.block_hashes, self._hash_block_size,
                self._ssep_token_id, range(self._num_groups)))
        super().on_new_request(request)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        # Runs in the API server, where no connector instance exists: the
        # offload metrics are chosen from the extra config, so complete it here too.
        apply_offload_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return super().build_prom_metrics(vllm_config, *args, **kwargs)
