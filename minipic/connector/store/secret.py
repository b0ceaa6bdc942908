"""The store secret: an optional shared key that authenticates every block file.

Without it a store trusts whoever can write to its directory (README, "Security"). With
it every block header carries HMAC-SHA256(secret, header), and the header holds the
payload's 256-bit BLAKE3 digest: an engine with the secret loads no block that someone
without it wrote, and counts each one it refuses (`minipic store stats`).

The secret comes from a file (connector option `store_secret_file`, `minipic store verify
--secret-file`) or from the environment (MINIPIC_STORE_SECRET), never from the JSON
config, and is never logged. Its identity, a key id derived from it that reveals nothing
about it, enters the store namespace: replicas with another secret, or none, write to
another folder, so they never refuse (and remove) each other's files.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from minipic.connector.store.regular_files import read_regular

ENV_VAR = "MINIPIC_STORE_SECRET"
MIN_BYTES = 16  # e.g. `openssl rand -hex 32 > secret` gives 64
_MAX_FILE_BYTES = 1 << 16
SCHEME = "hmac-sha256"


class SecretError(ValueError):
    """The secret is configured but unusable; the message never contains it."""


def load_secret(secret_file: str | os.PathLike | None,
                environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The store secret from `secret_file` or MINIPIC_STORE_SECRET; None if neither is set.
    A file's trailing newline is not part of the secret."""
    from_env = environ.get(ENV_VAR)
    if secret_file is not None and from_env is not None:
        raise SecretError(f"both a store secret file and {ENV_VAR} are set: use one")
    if secret_file is not None:
        source = f"store secret file {secret_file}"
        try:
            secret = read_regular(secret_file, _MAX_FILE_BYTES).rstrip(b"\r\n")
        except OSError as e:
            raise SecretError(f"cannot read the {source}: {e.strerror}") from None
    elif from_env is not None:
        source, secret = ENV_VAR, from_env.encode()
    else:
        return None
    if len(secret) < MIN_BYTES:
        raise SecretError(f"the {source} holds {len(secret)} bytes; a store secret needs at "
                          f"least {MIN_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret


def secret_id(secret: bytes) -> str:
    """What namespace.json records about the secret: its scheme and a key id."""
    return f"{SCHEME}:{hmac.new(secret, b'minipic store key id', hashlib.sha256).hexdigest()[:16]}"
