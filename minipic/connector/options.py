"""minipic's connector options, and the vLLM offload config they stand for.

Users write short minipic keys in `kv_connector_extra_config`:

    store_dir          directory of the span store (shared by replicas); omit for CPU only
    cpu_bytes          size of the CPU tier (default 2 GiB); vLLM's `cpu_bytes_to_use` also works
    disk_max_bytes     size limit of the store; least recently used blocks are evicted past it
                       (sizes: bytes, or text with a unit such as "8GiB", see minipic.sizes)
    disk_read_threads / disk_write_threads   I/O threads of the disk tier (default 4 / 4)
    disk_read_processes   reader processes for loads (default: half the CPUs, at most 16, none
                          below 8 CPUs; 0 reads on the threads, next to the scheduler's GIL)
    store_secret_file  a file holding the store secret: every block is authenticated (HMAC) and
                       unauthenticated ones are refused; or set MINIPIC_STORE_SECRET (README,
                       "Security"). The secret itself never goes in this config.
    ssep_token_id / pdep_token_id / pad_token_id / ...   span markers (see minipic.config)

`apply_offload_config` rewrites them, in place, into the keys vLLM's native
offload reads (`spec_name`, `spec_module_path`, `cpu_bytes_to_use`,
`secondary_tiers`). In place because every process reads that dict on its own:
the engine core and workers build the spec from it, the API server builds the
offload metrics from it. Other vLLM offload keys (e.g. `eviction_policy`)
pass through untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, MutableMapping

from minipic.config import ENGINE_OPTION_KEYS
from minipic.sizes import SizeError, parse_size

SPEC_NAME = "MiniPICOffloadingSpec"
SPEC_MODULE = "minipic.connector.spec"
TIER_TYPE = "minipic_disk"
DEFAULT_CPU_BYTES = 2 << 30
_APPLIED = "_minipic_applied"

logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers


class ConnectorConfigError(ValueError):
    """The connector's configuration cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    store_dir: str | None
    cpu_bytes: int
    disk_max_bytes: int | None
    disk_read_threads: int
    disk_write_threads: int
    disk_read_processes: int
    store_secret_file: str | None = None

    @classmethod
    def parse(cls, extra: MutableMapping[str, Any]) -> "ConnectorOptions":
        store_dir = extra.get("store_dir")
        if store_dir is not None and not isinstance(store_dir, str):
            raise ConnectorConfigError(f"store_dir must be a directory path, got {store_dir!r}")
        if store_dir is not None and not store_dir.strip():
            raise ConnectorConfigError("store_dir is empty: give a directory or leave it out")
        cpu = extra.get("cpu_bytes", extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES))
        disk_max = extra.get("disk_max_bytes")
        if disk_max is not None and store_dir is None:
            raise ConnectorConfigError("disk_max_bytes needs a store_dir")
        for key in ("block_size", "blocks_per_chunk"):
            if key in extra:
                # One offloaded chunk per block keeps every span block its own
                # file, found by its own (position-free) hash.
                raise ConnectorConfigError(
                    f"{key} is not supported by MiniPICConnector: spans are stored block by block")
        if extra.get("canonical_layout"):
            # It reorders the heads inside a page; replicas with and without it would
            # read each other's pages in the wrong order from one store.
            raise ConnectorConfigError(
                "canonical_layout is not supported by MiniPICConnector: the store keeps each "
                "block in the attention backend's own layout")
        secret_file = extra.get("store_secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or store_dir is None):
            raise ConnectorConfigError("store_secret_file must be the path of a file holding the "
                                       "store secret, next to a store_dir")
        if store_dir is not None:
            _check_secret(secret_file)
        _warn_unknown_keys(extra)
        if "secondary_tiers" in extra and not extra.get(_APPLIED):
            raise ConnectorConfigError(
                "MiniPICConnector sets up its own disk tier: use store_dir, not secondary_tiers")
        spec_name = extra.get("spec_name", SPEC_NAME)
        if spec_name != SPEC_NAME:
            raise ConnectorConfigError(
                f"MiniPICConnector runs its own offloading spec; remove spec_name={spec_name!r}")
        return cls(
            store_dir=str(store_dir) if store_dir is not None else None,
            cpu_bytes=positive_size("cpu_bytes", cpu),
            disk_max_bytes=positive_size("disk_max_bytes", disk_max) if disk_max is not None else None,
            disk_read_threads=positive_int("disk_read_threads", extra.get("disk_read_threads", 4)),
            disk_write_threads=positive_int("disk_write_threads", extra.get("disk_write_threads", 4)),
            disk_read_processes=read_processes(extra.get("disk_read_processes")),
            store_secret_file=secret_file,
        )

    def offload_config(self) -> dict[str, Any]:
        """The keys vLLM's TieringOffloadingSpec reads."""
        tiers = []
        if self.store_dir is not None:
            tiers.append({"type": TIER_TYPE, "root_dir": self.store_dir,
                          "max_bytes": self.disk_max_bytes,
                          "n_read_threads": self.disk_read_threads,
                          "n_write_threads": self.disk_write_threads,
                          "n_read_processes": self.disk_read_processes})
            if self.store_secret_file is not None:
                tiers[0]["secret_file"] = self.store_secret_file  # the path, not the secret
        return {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE,
                "cpu_bytes_to_use": self.cpu_bytes, "secondary_tiers": tiers}


# What MiniPICConnector reads, and the keys vLLM's offloading connector reads itself
# (0.25.1 and 0.32.0); anything else is most likely a typo.
MINIPIC_KEYS = frozenset({
    "store_dir", "cpu_bytes", "disk_max_bytes", "disk_read_threads", "disk_write_threads",
    "disk_read_processes", "store_secret_file", *ENGINE_OPTION_KEYS, _APPLIED})
VLLM_OFFLOAD_KEYS = frozenset({
    "spec_name", "spec_module_path", "cpu_bytes_to_use", "secondary_tiers", "eviction_policy",
    "backpressure", "enable_telemetry", "max_tracker_size", "offload_prompt_only",
    "self_describing_kv_events", "store_threshold"})


def _warn_unknown_keys(extra: MutableMapping[str, Any]) -> None:
    for key in sorted(set(extra) - MINIPIC_KEYS - VLLM_OFFLOAD_KEYS):
        logger.warning("MiniPICConnector: kv_connector_extra_config key %r is neither "
                       "minipic's nor vLLM's offload key; it has no effect (a typo? minipic's "
                       "keys: %s)", key, ", ".join(sorted(MINIPIC_KEYS - {_APPLIED})))


def _check_secret(secret_file: str | None) -> None:
    """Fail now, not in the engine core, if the secret is set but unusable (read, not kept)."""
    from minipic.connector.store.secret import SecretError, load_secret

    try:
        load_secret(secret_file)
    except SecretError as e:
        raise ConnectorConfigError(str(e)) from None


def positive_int(name: str, value: Any) -> int:
    # Not int(value): it would take 2.7 as 2 and True as 1.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        number = 0
    else:
        try:
            number = int(value)
        except ValueError:
            number = 0
    if number <= 0:
        raise ConnectorConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


def positive_size(name: str, value: Any) -> int:
    try:
        number = parse_size(value)
    except SizeError:
        number = 0
    if number <= 0:
        raise ConnectorConfigError(
            f"{name} must be a positive size in bytes, or with a unit like '8GiB' or "
            f"'512MiB', got {value!r}")
    return number


def default_read_processes() -> int:
    """Half the CPUs, at most 16; none below 8 CPUs, where the engine's own processes need
    them (on the 2-CPU test machine one reader made tiny-model loads slower, not faster).
    On the 32-CPU H200 host 16 processes read 13-15 GiB/s, 4 read 8-9 (bench_store_read.py)."""
    cpus = os.cpu_count() or 1
    return 0 if cpus < 8 else min(16, cpus // 2)


def read_processes(value: Any) -> int:
    if value is None:
        return default_read_processes()
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise ConnectorConfigError(f"disk_read_processes must be 0 or more, got {value!r}")
    return number


def apply_offload_config(extra: MutableMapping[str, Any]) -> ConnectorOptions:
    """Parse minipic's keys and add vLLM's offload keys to the same dict; idempotent."""
    options = ConnectorOptions.parse(extra)
    if not extra.get(_APPLIED):
        extra.update(options.offload_config())
        extra[_APPLIED] = True
    return options
