"""`minipic-preload` arguments: what is refused before any engine starts, with exit status 2."""

from __future__ import annotations

import pytest

from minipic.client.preload.cli import main


@pytest.mark.parametrize("argv, message", [
    (["corpus"], "give --url"),
    (["corpus", "--url", "http://localhost:8000", "--trust-server"],
     "--trust-server needs --block-size"),
    (["corpus", "--url", "http://x", "--block-size", "16", "--connector-config", "{}"],
     "in-process runs"),
    (["corpus", "--model", "m"], "store_dir"),
    (["corpus", "--model", "m", "--connector-config", '{"cpu_bytes": 1}'], "store_dir"),
    (["corpus", "--model", "m", "--connector-config", "missing.json"], "readable file"),
    (["corpus", "--model", "m", "--connector-config", "{oops"], "not JSON"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_2(tmp_path, capsys):
    code = main([str(tmp_path), "--url", "http://127.0.0.1:9", "--block-size", "16",
                 "--no-progress", "--manifest", str(tmp_path / "m.parquet")])
    assert code == 2 and "Connection" in capsys.readouterr().err
