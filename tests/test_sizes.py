"""Sizes in human units: one parser for cpu_bytes, disk_max_bytes and `store evict --max-bytes`."""

from __future__ import annotations

import pytest

from minipic.connector.options import ConnectorConfigError, apply_offload_config
from minipic.sizes import SizeError, format_size, parse_size


@pytest.mark.parametrize("text, size", [
    ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1.5GiB", 3 << 29), ("4kib", 4096),
    ("1GB", 10**9), ("123", 123), ("2048B", 2048), (4096, 4096), (8.0, 8),
])
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["abc", "", "8 GiBs", "-5", "GiB", True, 1.5, None, [1]])
def test_non_sizes_are_refused(bad):
    with pytest.raises(SizeError):
        parse_size(bad)


@pytest.mark.parametrize("size, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (3 << 29, "1.5 GiB"), (8 << 30, "8 GiB")])
def test_sizes_print_in_binary_units(size, text):
    assert format_size(size) == text
    assert parse_size(text) == size  # what is printed can be given back


def test_connector_sizes_take_units():
    options = apply_offload_config({"store_dir": "/s", "cpu_bytes": "8GiB",
                                    "disk_max_bytes": "200 GiB"})
    assert (options.cpu_bytes, options.disk_max_bytes) == (8 << 30, 200 << 30)
    assert apply_offload_config({"cpu_bytes_to_use": "512MiB"}).cpu_bytes == 512 << 20


@pytest.mark.parametrize("extra", [{"cpu_bytes": "abc"}, {"cpu_bytes": "0GiB"},
                                   {"store_dir": "/s", "disk_max_bytes": "lots"}])
def test_bad_connector_sizes_are_named(extra):
    [key] = [k for k in extra if k != "store_dir"]
    with pytest.raises(ConnectorConfigError, match=f"{key} must be a positive size.*8GiB"):
        apply_offload_config(extra)


def test_store_evict_takes_units(tmp_path, capsys):
    """A real store of 4 blocks of 1 MiB each, evicted down to "2.5MiB" (2 blocks stay)."""
    from minipic.cli import main
    from minipic.connector.store.block_file import write_block
    from minipic.connector.store.namespace import (StoreNamespace, block_path, namespace_fields,
                                                   open_namespace)

    fields = namespace_fields(model="m", model_fingerprint="f", dtype="float32", block_size=32,
                              kv_layout={"device": "cpu"}, hash_algo="sha256",
                              span_protocol={"ssep_token_id": 3, "pdep_token_id": 4,
                                             "pad_token_id": 5})
    namespace = StoreNamespace({**fields, "payload_bytes": 1 << 20})
    ns_dir = open_namespace(tmp_path, namespace)
    for i in range(4):
        write_block(block_path(ns_dir, bytes([i]) * 32, 0), namespace.digest,
                    bytes([i]) * 32 + bytes(4), bytes(1 << 20))
    assert main(["store", "evict", str(tmp_path), "--max-bytes", "2.5MiB"]) == 0
    assert "removed 2 blocks (2 MiB), 2 MiB left" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["store", "evict", str(tmp_path), "--max-bytes", "many"])
    assert "not a size: 'many'" in capsys.readouterr().err
