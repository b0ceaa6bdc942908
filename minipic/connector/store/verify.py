"""`minipic store verify`: check every block file exactly as an engine's load checks it.

A load expects, of the file at `block_path(ns_dir, hash, group)`: a regular file of one
header plus `payload_bytes`, this minipic's format, the namespace digest that names the
folder, the key that names the file, the payload's digest, and (with a store secret)
its MAC. `verify_block` runs those checks through the same code (`block_file.check_header`),
streaming the payload so memory stays bounded. A namespace folder no engine would read
from (its namespace.json describes another folder) is a problem of its own; folders of
another minipic version's format are reported and skipped, as engines skip them.

Every entry named like a block is checked, whatever it is: a directory, a FIFO or a
symbolic link where a block file belongs is reported (opening never blocks).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from minipic.connector.store import block_file
from minipic.connector.store.eviction import announce_removals
from minipic.connector.store.namespace import (
    block_key, block_key_of_path, is_other_version, list_namespaces, namespace_problem)
from minipic.connector.store.secret import secret_id


@dataclasses.dataclass
class VerifyResult:
    good: int = 0
    bad: int = 0  # block entries that fail a load's checks
    bad_namespaces: int = 0  # folders whose blocks no engine can use, or that could not be checked
    removed: int = 0
    kept: int = 0  # bad entries that --remove could not remove


def _block_entries(blocks_dir: Path) -> Iterator[str]:
    """Every entry under `blocks_dir` named like a block file, of any type."""
    for dirpath, dirnames, filenames in os.walk(blocks_dir):
        for name in (*filenames, *dirnames):
            if block_key_of_path(name) is not None:
                yield os.path.join(dirpath, name)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # only an empty one: a folder's contents are not ours to judge
    else:
        os.unlink(path)


def verify_store(root: str | os.PathLike, *, secret: bytes | None = None, remove: bool = False,
                 say: Callable[[str], None] = print) -> VerifyResult:
    """Check every namespace under `root`; `say` gets one line per problem as it is found."""
    result = VerifyResult()
    for ns_dir, fields in list_namespaces(root):
        problem = namespace_problem(ns_dir, fields)
        if is_other_version(fields):
            say(f"skipped: {ns_dir}: {problem}")
            continue
        if problem is None and not isinstance(fields.get("payload_bytes"), int):
            problem = "namespace.json gives no payload_bytes"
        if problem is not None:
            result.bad_namespaces += 1
            consequence = "its blocks are not checked" if fields is None \
                else "no engine loads its blocks"
            say(f"bad namespace: {ns_dir}: {problem}; {consequence}")
            continue
        # Engines with the secret read only folders named after it (secret.py), so a MAC is
        # checked exactly where one is expected.
        auth = fields.get("block_auth")
        mac_secret = secret if auth is not None and secret is not None \
            and secret_id(secret) == auth else None
        if auth is not None and mac_secret is None:
            result.bad_namespaces += 1
            why = "no store secret given" if secret is None else "the given secret is another"
            say(f"unauthenticated: {ns_dir}: its blocks are authenticated ({auth}) and {why} "
                f"(--secret-file or MINIPIC_STORE_SECRET): checked all but the MAC")
        _verify_namespace(ns_dir, fields, mac_secret, remove, say, result)
    if result.removed:
        announce_removals(root)  # running engines forget these blocks and store them again
    return result


def _verify_namespace(ns_dir: Path, fields: dict, secret: bytes | None, remove: bool,
                      say: Callable[[str], None], result: VerifyResult) -> None:
    namespace = bytes.fromhex(ns_dir.name[len("ns-"):])
    for path in _block_entries(ns_dir / "blocks"):
        block_hash, group = block_key_of_path(path)
        expected = block_file.Expected(namespace, block_key(block_hash, group),
                                       fields["payload_bytes"], secret)
        try:
            block_file.verify_block(path, expected)
        except FileNotFoundError:
            continue  # evicted or removed by another process meanwhile
        except (OSError, block_file.BlockRejected) as e:
            result.bad += 1
            say(f"bad: {path}: {e.strerror if isinstance(e, OSError) else e}")
            if remove:
                try:
                    _remove(path)
                    result.removed += 1
                except FileNotFoundError:
                    result.removed += 1  # gone already (evicted or removed by a replica)
                except OSError as e:
                    result.kept += 1
                    say(f"  could not remove it: {e}")
        else:
            result.good += 1
