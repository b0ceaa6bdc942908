"""minipic.devtools.page_cache: every file below the folder, left as it was."""

from __future__ import annotations

from minipic.devtools.page_cache import drop_from_page_cache


def test_drops_every_file_and_keeps_its_bytes(tmp_path):
    (tmp_path / "ns" / "blocks").mkdir(parents=True)
    files = [tmp_path / "a.kv", tmp_path / "ns" / "b.kv", tmp_path / "ns" / "blocks" / "c.kv"]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 4096)
    assert drop_from_page_cache(str(tmp_path)) == 3
    assert [f.read_bytes() for f in files] == [bytes([i]) * 4096 for i in range(3)]
