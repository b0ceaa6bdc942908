"""minipic's span store connector for vLLM (`kv_connector_module_path: "minipic.connector"`).

    connector.py        MiniPICConnector: vLLM's OffloadingConnector + minipic options
    options.py          minipic's extra-config keys -> vLLM's offload config
    spec.py             the offloading spec both sides build (manager / worker)
    compat.py           vLLM 0.25 vs 0.32 differences, in one place
    scheduler/          engine-core side: disk tier, store namespace, span heads
    worker/             worker side: KV block copier for the CPU platform
    store/              the on-disk format: namespace, block files, eviction, stats

`MiniPICConnector` is imported lazily so `minipic store ...` (which only
needs `store/`) starts without importing vLLM.
"""

from typing import Any

__all__ = ["MiniPICConnector"]


def __getattr__(name: str) -> Any:
    if name == "MiniPICConnector":
        from minipic.connector.connector import MiniPICConnector

        return MiniPICConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
