"""`minipic store verify` judges every entry as an engine's load does, never hangs, and
streams; the store secret (option, environment, CLI) and block format versions."""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from minipic.cli import main
from minipic.connector.options import ConnectorConfigError, apply_offload_config
from minipic.connector.store import block_file
from minipic.connector.store.block_file import BlockRejected, read_block_into, write_block
from minipic.connector.store.namespace import (
    StoreNamespace, block_key, block_path, namespace_fields, open_namespace)
from minipic.connector.store.secret import ENV_VAR, SecretError, load_secret, secret_id

FIELDS = namespace_fields(model="m", model_fingerprint="f", dtype="float32", block_size=32,
                          kv_layout={"device": "cpu"}, hash_algo="sha256",
                          span_protocol={"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5})
ROW = 4096
NS = StoreNamespace({**FIELDS, "payload_bytes": ROW})
OTHER_NS = StoreNamespace({**FIELDS, "dtype": "bfloat16", "payload_bytes": ROW})
SECRET = b"an-example-store-secret-of-32-by"
REPO = Path(__file__).resolve().parents[2]


def payload(seed: int) -> bytes:
    return bytes((i * 7 + seed) % 256 for i in range(ROW))


def h(i: int) -> bytes:
    return bytes([i]) * 32


def good_block(ns_dir: Path, i: int, ns: StoreNamespace = NS, secret: bytes | None = None) -> str:
    path = block_path(ns_dir, h(i), 0)
    write_block(path, ns.digest, block_key(h(i), 0), payload(i), secret=secret)
    return path


def loads(path: str, i: int, secret: bytes | None = None) -> bool:
    """What an engine's load of block i from `path` does."""
    try:
        read_block_into(path, NS.digest, block_key(h(i), 0), memoryview(bytearray(ROW)), secret)
        return True
    except (BlockRejected, OSError):
        return False


def verify(root: Path, *args: str, env: dict | None = None, memory_bytes: int = 1 << 30):
    """The CLI in a process of its own: with a cap on its memory, and a timeout (it used to
    hang on FIFOs, read /dev/zero without end and whole 10 GB files into memory)."""
    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    env = {**{k: v for k, v in os.environ.items() if k != ENV_VAR}, "PYTHONPATH": str(REPO),
           **(env or {})}
    done = subprocess.run([sys.executable, "-m", "minipic.cli", "store", "verify", str(root), *args],
                          capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=cap_memory)
    return done.returncode, done.stdout + done.stderr


def v1_block(path: str, i: int) -> None:
    """A block file as minipic's first format wrote it: 128-byte header, no MAC."""
    body = struct.Struct("<8sHHHH16s64sQ16s").pack(
        block_file.MAGIC, 1, 0, 36, 0, NS.digest, block_key(h(i), 0), ROW,
        block_file.payload_digest(payload(i))[:16])
    Path(path).write_bytes(body + struct.pack("<I", zlib.crc32(body)) + bytes(4) + payload(i))


def hostile_store(root: Path) -> tuple[list[str], dict[str, str]]:
    """Two good blocks and one entry of each kind a load refuses, named as blocks."""
    ns_dir = open_namespace(root, NS)
    good = [good_block(ns_dir, 1), good_block(ns_dir, 2)]
    bad = {name: block_path(ns_dir, h(i), 0) for i, name in enumerate(
        ["fifo", "link to fifo", "link to /dev/zero", "directory", "sparse 10 GB",
         "swapped a", "swapped b", "other namespace", "version 1", "corrupt"], start=10)}
    Path(bad["fifo"]).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(bad["fifo"])
    for name, path in bad.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        i = int(Path(path).name[:2], 16)
        if name == "link to fifo":
            os.symlink(bad["fifo"], path)
        elif name == "link to /dev/zero":
            os.symlink("/dev/zero", path)
        elif name == "directory":
            os.mkdir(path)
        elif name == "sparse 10 GB":
            good_block(ns_dir, i)
            os.truncate(path, 10 << 30)
        elif name == "other namespace":  # a good block of another configuration, copied in
            other = block_path(open_namespace(root / "elsewhere", OTHER_NS), h(i), 0)
            write_block(other, OTHER_NS.digest, block_key(h(i), 0), payload(i))
            Path(path).write_bytes(Path(other).read_bytes())
        elif name == "version 1":
            v1_block(path, i)
        elif name == "corrupt":
            good_block(ns_dir, i)
            data = bytearray(Path(path).read_bytes())
            data[-1] ^= 1
            Path(path).write_bytes(bytes(data))
        elif name == "swapped a":
            good_block(ns_dir, i)
    # Two good files that trade places: each is intact, under the other's name.
    b = bad["swapped b"]
    write_block(b, NS.digest, block_key(h(int(Path(b).name[:2], 16)), 0), payload(0))
    a_data, b_data = Path(bad["swapped a"]).read_bytes(), Path(b).read_bytes()
    Path(bad["swapped a"]).write_bytes(b_data)
    Path(b).write_bytes(a_data)
    return good, bad


def test_verify_reports_every_entry_a_load_refuses_and_never_hangs(tmp_path):
    good, bad = hostile_store(tmp_path)
    rc, out = verify(tmp_path)
    assert rc == 1, out
    bad_lines = [line for line in out.splitlines() if line.startswith("bad: ")]
    for name, path in bad.items():
        assert any(line.startswith(f"bad: {path}: ") for line in bad_lines), (name, out)
    assert not any(p in out for p in good)
    assert f"2 good, {len(bad)} bad" in out
    reasons = "\n".join(bad_lines)
    for reason in ("a FIFO", "a symbolic link", "a directory", "longer", "key mismatch",
                   "namespace mismatch", "format version 1", "payload checksum mismatch"):
        assert reason in reasons, reason

    rc, out = verify(tmp_path, "--remove")
    assert rc == 0 and f"({len(bad)} removed, 0 could not be)" in out, out
    assert verify(tmp_path) == (0, "2 good, 0 bad\n")
    assert all(loads(p, i) for i, p in enumerate(good, start=1))


def test_verify_judges_exactly_what_a_load_judges(tmp_path):
    """Every entry of the hostile store: bad for verify if and only if a load refuses it."""
    from minipic.connector.store.verify import verify_store

    good, bad = hostile_store(tmp_path)
    os.unlink(bad.pop("sparse 10 GB"))  # loads of it are tested above, in bounded memory
    reported: list[str] = []
    result = verify_store(tmp_path, say=reported.append)
    for path in [*good, *bad.values()]:
        i = int(Path(path).name[:2], 16)
        verdict_of_verify = not any(line.startswith(f"bad: {path}: ") for line in reported)
        assert verdict_of_verify == loads(path, i), path
    assert (result.good, result.bad) == (len(good), len(bad))


def test_a_namespace_folder_no_engine_reads_is_reported(tmp_path):
    ns_dir = open_namespace(tmp_path, NS)
    good_block(ns_dir, 1)
    copied = tmp_path / OTHER_NS.dirname  # a whole namespace folder under another's name
    (copied / "blocks").mkdir(parents=True)
    (copied / "namespace.json").write_bytes((ns_dir / "namespace.json").read_bytes())
    old = tmp_path / StoreNamespace({**NS.fields, "format_version": 1}).dirname
    (old / "blocks").mkdir(parents=True)  # another minipic version's: skipped, as engines do
    (old / "namespace.json").write_text('{"format": "minipic-span-store", "format_version": 1}')
    rc, out = verify(tmp_path)
    assert rc == 1 and f"bad namespace: {copied}: namespace.json does not match" in out, out
    assert f"skipped: {old}: store format version 1" in out


def test_store_secret_sources(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(str(path), environ={}) == SECRET  # the newline is not part of it
    assert load_secret(None, environ={ENV_VAR: SECRET.decode()}) == SECRET
    assert load_secret(None, environ={}) is None
    with pytest.raises(SecretError, match="use one"):
        load_secret(str(path), environ={ENV_VAR: SECRET.decode()})
    path.write_bytes(b"short\n")
    with pytest.raises(SecretError, match="at least 16") as e:
        load_secret(str(path), environ={})
    assert "short" not in str(e.value)
    os.unlink(path)
    os.mkfifo(path)  # never blocks here either
    with pytest.raises(SecretError, match="not a regular file"):
        load_secret(str(path), environ={})
    assert secret_id(SECRET).startswith("hmac-sha256:") and SECRET.hex() not in secret_id(SECRET)


def test_the_secret_option_names_a_file_and_fails_at_config_time(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    extra = {"store_dir": str(tmp_path / "store"), "store_secret_file": str(path)}
    apply_offload_config(extra)
    assert extra["secondary_tiers"][0]["secret_file"] == str(path)
    assert SECRET.decode() not in repr(extra)
    with pytest.raises(ConnectorConfigError, match="cannot read the store secret file"):
        apply_offload_config({"store_dir": "/s", "store_secret_file": str(tmp_path / "none")})
    with pytest.raises(ConnectorConfigError, match="next to a store_dir"):
        apply_offload_config({"store_secret_file": str(path)})
    monkeypatch.setenv(ENV_VAR, "too short")
    with pytest.raises(ConnectorConfigError, match=ENV_VAR):
        apply_offload_config({"store_dir": "/s"})


def test_verify_checks_macs_with_the_secret(tmp_path):
    auth_ns = StoreNamespace({**NS.fields, "block_auth": secret_id(SECRET)})
    ns_dir = open_namespace(tmp_path, auth_ns)
    good_block(ns_dir, 1, auth_ns, SECRET)
    forged = good_block(ns_dir, 2, auth_ns)  # valid header and checksum, no MAC
    wrong = good_block(ns_dir, 3, auth_ns, b"another secret, not the store's")
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)

    rc, out = verify(tmp_path, "--secret-file", str(secret_file))
    assert rc == 1 and "1 good, 2 bad" in out, out
    assert f"bad: {forged}: not authenticated" in out and f"bad: {wrong}: authentication failed" in out
    assert verify(tmp_path, env={ENV_VAR: SECRET.decode()})[1] == out  # the same from the env

    rc, out = verify(tmp_path)  # without the secret: everything but the MACs, and it says so
    assert rc == 1 and "3 good, 0 bad, 1 namespace problem(s)" in out, out
    assert "no store secret given" in out
    assert SECRET.decode() not in out


def test_block_files_of_another_format_version_are_refused_by_name(tmp_path):
    path = str(tmp_path / "a.kv")
    v1_block(path, 1)
    with pytest.raises(BlockRejected, match="format version 1 .*expected 2"):
        read_block_into(path, NS.digest, block_key(h(1), 0), memoryview(bytearray(ROW)))
    assert StoreNamespace({**NS.fields, "format_version": 1}).dirname != NS.dirname


def test_block_key_is_vllms_offload_key():
    from vllm.v1.kv_offload.base import make_offload_key

    assert block_key(h(7), 3) == make_offload_key(h(7), 3)
