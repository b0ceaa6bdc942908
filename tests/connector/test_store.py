"""The span store on its own: namespaces, block files, atomicity, eviction, stats, CLI, options."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from minipic.connector.options import (
    ConnectorConfigError, apply_offload_config, default_read_processes)
from minipic.connector.store import block_file
from minipic.connector.store.block_file import BlockRejected, read_block_into, write_block
from minipic.connector.store.eviction import evict_lru, _exclusive
from minipic.connector.store.namespace import (
    NamespaceMismatch, StoreNamespace, block_key, block_path, namespace_fields, open_namespace)
from minipic.connector.store.stats import NotAStore, scan_store

FIELDS = namespace_fields(model="m@default", model_fingerprint="f", dtype="float32", block_size=32,
                          kv_layout={"device": "cpu"}, hash_algo="sha256",
                          span_protocol={"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5})
NS = StoreNamespace({**FIELDS, "payload_bytes": 4096})
KEY = bytes(range(32)) + b"\0\0\0\0"


def payload(seed: int = 1, n: int = 4096) -> bytes:
    return bytes((i * seed + seed) % 256 for i in range(n))


def test_roundtrip(tmp_path):
    path = str(tmp_path / "a.kv")
    write_block(path, NS.digest, KEY, payload(), flags=block_file.FLAG_SPAN_HEAD)
    dest = bytearray(4096)
    read_block_into(path, NS.digest, KEY, memoryview(dest))
    assert bytes(dest) == payload()
    assert block_file.read_header(path)["flags"] == block_file.FLAG_SPAN_HEAD
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize("how", ["intact", "extended"])
def test_short_reads_are_continued_not_taken_for_truncation(tmp_path, monkeypatch, how):
    """readv may return early (FUSE, network file systems): a good file must still load,
    and a bad one must still be rejected."""
    path = str(tmp_path / "a.kv")
    write_block(path, NS.digest, KEY, payload())
    if how == "extended":
        _damage(path, how)
    real_readv = os.readv

    def short_readv(fd, buffers):  # at most 1000 bytes per call
        first = memoryview(next(b for b in buffers if len(b))).cast("B")
        return real_readv(fd, [first[:1000]])

    monkeypatch.setattr(block_file.os, "readv", short_readv)
    dest = bytearray(4096)
    if how == "intact":
        read_block_into(path, NS.digest, KEY, memoryview(dest))
        assert bytes(dest) == payload()
    else:
        with pytest.raises(BlockRejected, match="longer"):
            read_block_into(path, NS.digest, KEY, memoryview(dest))


def _damage(path: str, how: str) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "truncated":
        data = data[:-100]
    elif how == "extended":  # bytes after the payload: not a file this code wrote
        data += b"\0"
    elif how == "payload":
        data[block_file.HEADER_LEN + 7] ^= 0xFF
    elif how == "header":
        data[20] ^= 0xFF
    elif how == "stock":  # what vLLM's FS tier writes: raw bytes, no header
        data = bytearray(payload(3, block_file.HEADER_LEN + 4096))
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "extended", "payload", "header", "stock"])
def test_damaged_files_are_rejected(tmp_path, how):
    path = str(tmp_path / "a.kv")
    write_block(path, NS.digest, KEY, payload())
    _damage(path, how)
    with pytest.raises(BlockRejected) as e:
        read_block_into(path, NS.digest, KEY, memoryview(bytearray(4096)))
    assert e.value.inode == os.stat(path).st_ino


def test_foreign_namespace_and_key_are_rejected(tmp_path):
    path = str(tmp_path / "a.kv")
    other = StoreNamespace({**FIELDS, "dtype": "bfloat16", "payload_bytes": 4096})
    write_block(path, other.digest, KEY, payload())
    with pytest.raises(BlockRejected, match="namespace"):
        read_block_into(path, NS.digest, KEY, memoryview(bytearray(4096)))
    write_block(path, NS.digest, KEY[::-1], payload())
    with pytest.raises(BlockRejected, match="key"):
        read_block_into(path, NS.digest, KEY, memoryview(bytearray(4096)))


def test_namespaces_separate_configurations(tmp_path):
    a = open_namespace(tmp_path, NS)
    b = open_namespace(tmp_path, StoreNamespace({**NS.fields, "kv_layout": {"device": "cuda"}}))
    assert a != b and a.parent == b.parent == tmp_path
    assert open_namespace(tmp_path, NS) == a  # joining is idempotent
    (a / "namespace.json").write_text('{"model": "someone else"}')
    with pytest.raises(NamespaceMismatch):
        open_namespace(tmp_path, NS)


def test_unusable_root_raises_oserror(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        open_namespace(tmp_path / "file" / "store", NS)


def _writer(path: str, seed: int, rounds: int) -> None:
    for _ in range(rounds):
        write_block(path, NS.digest, KEY, payload(seed=1, n=1 << 20))


def _reader(path: str, stop_at: float, q) -> None:
    dest = memoryview(bytearray(1 << 20))
    ok = missing = 0
    # On a loaded host a reader may start after stop_at: it still reads until it has a block.
    while time.time() < stop_at or (ok == 0 and time.time() < stop_at + 60):
        try:
            read_block_into(path, NS.digest, KEY, dest)
            ok += 1
        except FileNotFoundError:
            missing += 1
        except BlockRejected as e:  # a torn file: must never happen
            q.put(("torn", str(e)))
            return
    q.put(("ok", ok))


def test_concurrent_writers_never_expose_a_torn_block(tmp_path):
    """Processes rewrite one 1 MiB block while others read it: every read is whole."""
    path = str(tmp_path / "blocks" / "a.kv")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop_at = time.time() + 4
    readers = [ctx.Process(target=_reader, args=(path, stop_at, q)) for _ in range(2)]
    writers = [ctx.Process(target=_writer, args=(path, 1, 60)) for _ in range(3)]
    for p in readers + writers:
        p.start()
    for p in readers + writers:
        p.join(60)
    results = [q.get(timeout=5) for _ in readers]
    assert all(kind == "ok" for kind, _ in results), results
    assert sum(n for _, n in results) > 0
    assert not [p for p in os.listdir(tmp_path / "blocks") if p.endswith(".tmp")]


def _fill(root: Path, n: int, size: int = 1000) -> list[str]:
    ns_dir = open_namespace(root, NS)
    paths = []
    for i in range(n):
        path = block_path(ns_dir, bytes([i]) * 32, 0)
        write_block(path, NS.digest, KEY, b"x" * size)
        os.utime(path, (1000 + i, 1000 + i))  # block i used at time 1000 + i
        paths.append(path)
    return paths


def test_eviction_removes_least_recently_used(tmp_path):
    paths = _fill(tmp_path, 10)
    file_size = os.path.getsize(paths[0])
    os.utime(paths[0], None)  # block 0 just used: it must survive
    result = evict_lru(tmp_path, max_bytes=6 * file_size, low_watermark=1.0)
    assert result.ran and result.removed_files == 4
    assert [os.path.exists(p) for p in paths] == [True] + [False] * 4 + [True] * 5
    assert evict_lru(tmp_path, max_bytes=6 * file_size).removed_files == 0


def test_one_evictor_at_a_time(tmp_path):
    _fill(tmp_path, 3)
    with _exclusive(tmp_path) as mine:
        assert mine
        assert evict_lru(tmp_path, max_bytes=1).ran is False


def test_stats_and_cli(tmp_path, capsys):
    from minipic.cli import main

    ns_dir = open_namespace(tmp_path, NS)
    for i in range(3):
        block_hash = bytes([i]) * 32
        write_block(block_path(ns_dir, block_hash, 0), NS.digest, block_key(block_hash, 0),
                    payload(), flags=block_file.FLAG_SPAN_HEAD if i == 0 else 0)
    (ns_dir / "stats").mkdir()
    (ns_dir / "stats" / "p1.json").write_text(
        '{"hit_blocks": 5, "hit_bytes": 20480, "load_jobs": 2, "load_us": 4000}')
    (ns_dir / "stats" / "p2.json").write_text('{"hit_blocks": 2}')
    (ns_dir / "stats" / "p3.json").write_text('[]')  # not a counters file: ignored
    (ns_dir / "stats" / "p4.json").write_text('{"hit_blocks": "many"}')
    [ns] = scan_store(tmp_path)
    assert (ns.spans, ns.blocks, ns.counters["hit_blocks"]) == (1, 3, 7)
    assert ns.bytes == 3 * (block_file.HEADER_LEN + 4096)
    assert main(["store", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "spans      1" in out and "blocks     3" in out and "hits       7 blocks" in out
    assert "loads      2 jobs, 2.0 ms each on average" in out

    bad = block_path(ns_dir, bytes([1]) * 32, 0)
    assert main(["store", "verify", str(tmp_path)]) == 0
    assert "3 good, 0 bad" in capsys.readouterr().out
    _damage(bad, "payload")
    assert main(["store", "verify", str(tmp_path)]) == 1
    assert "2 good, 1 bad" in capsys.readouterr().out
    assert main(["store", "verify", str(tmp_path), "--remove"]) == 0
    assert not os.path.exists(bad)


def test_cli_reports_what_it_could_not_do(tmp_path, monkeypatch, capsys):
    from minipic.cli import main
    from minipic.connector.store import eviction

    ns_dir = open_namespace(tmp_path, NS)
    bad = block_path(ns_dir, bytes([1]) * 32, 0)
    write_block(bad, NS.digest, KEY, payload())
    _damage(bad, "payload")
    real_unlink = os.unlink

    def read_only(path, *args, **kwargs):
        if str(path) == bad:
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", read_only)
    assert main(["store", "verify", str(tmp_path), "--remove"]) == 1  # still there: a failure
    assert "0 removed, 1 could not be" in capsys.readouterr().out
    monkeypatch.undo()

    def no_lock(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / eviction.LOCK_FILE))

    monkeypatch.setattr(eviction, "evict_lru", no_lock)
    assert main(["store", "evict", str(tmp_path), "--max-bytes", "0"]) == 1
    assert "cannot evict" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a negative limit would empty the store
        main(["store", "evict", str(tmp_path), "--max-bytes", "-5"])


def test_stock_vllm_dir_is_not_a_store(tmp_path, capsys):
    from minipic.cli import main

    stock = tmp_path / "model_0123456789ab"
    stock.mkdir()
    (stock / "config.json").write_text('{"inference_engine": "vllm", "model_name": "m"}')
    with pytest.raises(NotAStore, match="stock vLLM"):
        scan_store(tmp_path)
    assert main(["store", "stats", str(tmp_path)]) == 2


def test_options_become_vllm_offload_config():
    extra = {"store_dir": "/s", "cpu_bytes": 1 << 20, "disk_max_bytes": 1 << 30,
             "eviction_policy": "arc"}
    options = apply_offload_config(extra)
    assert options.store_dir == "/s"
    assert extra["spec_name"] == "MiniPICOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 1 << 20 and extra["eviction_policy"] == "arc"
    assert extra["secondary_tiers"] == [{"type": "minipic_disk", "root_dir": "/s",
                                         "max_bytes": 1 << 30, "n_read_threads": 4,
                                         "n_write_threads": 4,
                                         "n_read_processes": default_read_processes()}]
    before = dict(extra)
    apply_offload_config(extra)
    assert extra == before  # every process applies it; once is enough
    assert apply_offload_config({}).store_dir is None  # CPU tier only


@pytest.mark.parametrize("extra, message", [
    ({"store_dir": ""}, "empty"),
    ({"cpu_bytes": 0}, "positive"),
    ({"disk_max_bytes": 10}, "store_dir"),
    ({"block_size": 64}, "block by block"),
    ({"spec_name": "CPUOffloadingSpec"}, "own offloading spec"),
    ({"secondary_tiers": []}, "store_dir"),
    ({"disk_read_processes": -1}, "0 or more"),
    ({"canonical_layout": True}, "backend's own layout"),
])
def test_bad_options_fail_clearly(extra, message):
    with pytest.raises(ConnectorConfigError, match=message):
        apply_offload_config(extra)


def test_eviction_sweeps_temp_files_of_dead_writers(tmp_path):
    import os
    import time

    from minipic.connector.store.eviction import evict_lru

    ns_dir = open_namespace(tmp_path, NS)
    stale = Path(block_path(ns_dir, bytes([1]) * 32, 0) + ".123.abc.tmp")
    fresh = Path(block_path(ns_dir, bytes([2]) * 32, 0) + ".456.def.tmp")
    for path in (stale, fresh):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    evict_lru(tmp_path, max_bytes=1 << 20)
    assert not stale.exists() and fresh.exists()  # a live writer's file stays


def test_eviction_and_verify_touch_nothing_but_block_files(tmp_path):
    """A store_dir pointed at a folder with other files: none of them is ever removed."""
    from minipic.cli import main

    others = [tmp_path / "projects" / "model.kv", tmp_path / "projects" / "draft.tmp",
              tmp_path / "ns-notes" / "blocks" / "readme.kv"]
    for path in others:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a block")
        os.utime(path, (1000, 1000))  # older than every block, and than STALE_TEMP_S
    paths = _fill(tmp_path, 3)
    assert evict_lru(tmp_path, max_bytes=0, low_watermark=1.0).removed_files == 3
    assert main(["store", "verify", str(tmp_path), "--remove"]) == 0
    assert all(p.exists() for p in others) and not any(os.path.exists(p) for p in paths)


def test_a_mistyped_option_is_named_in_a_warning():
    import logging

    class Collect(logging.Handler):  # vLLM's loggers may not propagate to pytest's
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logger, collect = logging.getLogger("vllm.minipic.connector"), Collect()
    logger.addHandler(collect)
    try:
        apply_offload_config({"store_directory": "/data/spans", "eviction_policy": "lru"})
    finally:
        logger.removeHandler(collect)
    [message] = [m for m in collect.messages if "store_directory" in m]
    assert "no effect" in message and "store_dir" in message
    assert not [m for m in collect.messages if "eviction_policy" in m]


def test_kv_layout_separates_what_changes_page_bytes(monkeypatch):
    """Replicas whose pages are laid out differently must not share a namespace."""
    from types import SimpleNamespace

    from minipic.connector.scheduler.identity import kv_layout

    def layout(tp: int = 1, minipic: dict | None = None) -> dict:
        spec = SimpleNamespace(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16",
                               page_size_bytes=16 * 8 * 128 * 2 * 2)
        kv_cache_config = SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, layer_names=["layers.0.attn"])])
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(quantization=None),
            cache_config=SimpleNamespace(kv_cache_layout=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            kv_transfer_config=None, additional_config={"minipic": minipic or {}})
        connector = SimpleNamespace(get_required_kvcache_layout=lambda config: "HND")
        return kv_layout(vllm_config, kv_cache_config, connector)

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    default = layout()
    assert "env_kv_cache_layout" not in default  # stores made without it keep their name
    assert layout(tp=2) != default
    assert layout(minipic={"mask_markers": False}) == default
    assert layout(minipic={"mask_markers": True}) != default  # other KV for every span
    assert layout(minipic={"span_scale": 1}) == default
    assert layout(minipic={"span_scale": 0.5}) != default  # other KV for links and tasks
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    assert layout() != default


def test_eviction_never_follows_a_link_in_the_lock_file_place(tmp_path):
    """A planted symlink at the eviction lock's path is refused, its target untouched."""
    from minipic.connector.store.eviction import LOCK_FILE, evict_lru

    target = tmp_path / "elsewhere"
    store = tmp_path / "store"
    store.mkdir()
    (store / LOCK_FILE).symlink_to(target)
    with pytest.raises(OSError):
        evict_lru(store, max_bytes=0)
    assert not target.exists()
