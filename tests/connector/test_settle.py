"""wait_until_settled: an in-process preload waits for the store to stop growing."""

import threading
import time

from minipic.connector.store.settle import wait_until_settled


def _writer(root, n, every_s):
    blocks = root / f"ns-{0:032x}" / "blocks"  # a store's layout: block files named by hash
    blocks.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (blocks / f"{i:064x}_g0.kv").write_bytes(b"x" * 100)
        time.sleep(every_s)


def test_returns_once_writes_stop(tmp_path):
    writer = threading.Thread(target=_writer, args=(tmp_path, 6, 0.2))
    writer.start()
    assert wait_until_settled(tmp_path, quiet_s=0.8, poll_s=0.05, timeout_s=30)
    assert not writer.is_alive()  # it waited for the last write (and 0.8 s of quiet)
    writer.join()


def test_gives_up_on_a_store_that_keeps_growing(tmp_path):
    writer = threading.Thread(target=_writer, args=(tmp_path, 40, 0.1))
    writer.start()
    assert not wait_until_settled(tmp_path, quiet_s=1.0, poll_s=0.05, timeout_s=1.5)
    writer.join()
