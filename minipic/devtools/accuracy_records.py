"""bench_accuracy's per-question records: JSON lines, gzip members, read back whole or
cut. tools/bench_accuracy.py writes and summarises them; tools/accuracy_variants.py
checks the HF reference against them."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a (possibly partial) file, gzip or plain JSON lines; what a killed
    run left cut (a truncated line or gzip stream) is dropped."""
    if not path.exists():
        return []
    data = path.read_bytes()
    texts = _gunzip_members(data) if path.suffix == ".gz" else [data]
    records = []
    for text in texts:
        for line in text.decode(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill ends what this member holds
    return records


def _gunzip_members(data: bytes) -> list[bytes]:
    """What each gzip member in `data` decodes to, up to where it was cut. Each --resume
    appends a member; a member a kill cut short is followed by the next run's, so after
    a cut the next member is looked for at the next gzip header."""
    out, start = [], 0
    while start < len(data):
        member = zlib.decompressobj(16 + zlib.MAX_WBITS)
        decoded, pos = [], start
        while pos < len(data) and not member.eof:
            chunk, saved = data[pos:pos + 4096], member.copy()
            try:
                decoded.append(member.decompress(chunk))
                pos += len(chunk)
            except zlib.error:  # the cut: keep what decodes before it, byte by byte
                member = saved
                for i in range(len(chunk)):
                    try:
                        decoded.append(member.decompress(chunk[i:i + 1]))
                    except zlib.error:
                        break
                break
        out.append(b"".join(decoded))
        if member.eof:
            start = pos - len(member.unused_data)  # unused_data: the rest of the last chunk
        else:
            found = data.find(b"\x1f\x8b\x08", start + 1)
            if found < 0:
                break
            start = found
    return out
