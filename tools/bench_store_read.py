"""What limits the disk tier's loads on a host: the files, the hash, threads, or the GIL?

    python3 tools/bench_store_read.py --dir /tmp/store-read --blocks 630 --block-mib 2

Writes `--blocks` block files the way the store does (minipic.connector.store.block_file), then
reads them all into one buffer (shared memory, like the CPU tier) in several ways, each twice,
and prints GiB/s:
  threads=T        read_block_into on T threads (the disk tier's load path);
  +busy            the same next to a Python thread that loops 3 ms and sleeps 1 ms, the
                   engine core's pattern while a request waits for its load;
  no-verify        plain os.readv without the header and blake3 checks;
  processes=P      read_block_into in P processes of their own (own GIL), one chunk each.
No GPU, no vLLM: runs in under a minute on the GPU host, where docs/connector.md measured
6-7.5 GiB/s for the same work inside an engine. The files stay in the page cache (written just
before); `--cold` drops them from it (posix_fadvise) before every pass.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minipic.connector.scheduler.prefault import prefault  # noqa: E402
from minipic.connector.store import block_file  # noqa: E402
from minipic.devtools.page_cache import drop_from_page_cache  # noqa: E402
from minipic.devtools.timing import timed  # noqa: E402

NAMESPACE = b"bench-store-read"  # 16 bytes, like a store namespace digest


def key_of(i: int) -> bytes:
    return f"block-{i}".encode()


def write_blocks(directory: Path, blocks: int, block_bytes: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(block_bytes)
    paths = [str(directory / f"{i}.kv") for i in range(blocks)]
    for i, path in enumerate(paths):
        block_file.write_block(path, NAMESPACE, key_of(i), payload)
    return paths


def shared_buffer(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def read_range(paths: list[str], first: int, count: int, buffer: memoryview, block_bytes: int,
               verify: bool = True) -> None:
    for i in range(first, first + count):
        dest = buffer[i * block_bytes:(i + 1) * block_bytes]
        if verify:
            block_file.read_block_into(paths[i], NAMESPACE, key_of(i), dest)
        else:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.readv(fd, [bytearray(block_file.HEADER_LEN), dest])
            finally:
                os.close(fd)


def with_threads(paths, buffer, block_bytes, threads: int, verify: bool = True) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: read_range(paths, i, 1, buffer, block_bytes, verify),
                      range(len(paths))))


def _process_reader(paths, shm_path, first, count, block_bytes, ready, go) -> None:
    region = shared_buffer(shm_path, len(paths) * block_bytes)
    view = memoryview(region)
    prefault(view)  # as the disk tier does: time the reads, not first-touch faults
    ready.wait()
    go.wait()
    read_range(paths, first, count, view, block_bytes)
    view.release()
    region.close()


def with_processes(paths, shm_path, block_bytes, processes: int) -> float:
    """Seconds from releasing the ready readers to the last one finishing."""
    ctx = mp.get_context("fork")  # no threads yet in this process when it forks
    ready, go = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    share = -(-len(paths) // processes)
    workers = [ctx.Process(target=_process_reader,
                           args=(paths, shm_path, k * share,
                                 max(0, min(share, len(paths) - k * share)), block_bytes,
                                 ready, go))
               for k in range(processes)]
    for w in workers:
        w.start()
    ready.wait()
    start = time.perf_counter()
    go.wait()
    for w in workers:
        w.join()
        if w.exitcode:
            raise RuntimeError(f"reader process failed ({w.exitcode})")
    return time.perf_counter() - start


@contextlib.contextmanager
def busy_python_thread():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + 0.003
            while time.perf_counter() < until:
                pass
            time.sleep(0.001)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/minipic-store-read"))
    parser.add_argument("--blocks", type=int, default=630, help="630 = 10 documents of 1000 "
                        "tokens of Llama-3-8B at block size 16")
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--processes", default="4,16")
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    block_bytes = int(args.block_mib * 2**20)
    paths = write_blocks(args.dir / "blocks", args.blocks, block_bytes)
    os.sync()
    shm_path = f"/dev/shm/minipic-store-read-{os.getpid()}"
    region = shared_buffer(shm_path, args.blocks * block_bytes)
    buffer = memoryview(region)
    prefault(buffer)
    total = args.blocks * block_bytes / 2**30

    def measure(name: str, run) -> None:
        """`run()` reads every block; it may return its own timing (seconds) instead."""
        rates = []
        for _ in range(2):
            if args.cold:
                drop_from_page_cache(str(args.dir / "blocks"))
            elapsed, own = timed(run)
            seconds = own or elapsed
            rates.append(total / seconds)
        print(f"{name:28s} " + "  ".join(f"{r:6.2f}" for r in rates) + "  GiB/s", flush=True)

    print(f"{args.blocks} blocks of {args.block_mib} MiB ({total:.2f} GiB), "
          f"{'cold' if args.cold else 'page cache warm'}, {os.cpu_count()} CPUs")
    try:
        # Processes first: fork before this process has any thread.
        for p in (int(x) for x in args.processes.split(",") if x):
            measure(f"processes={p}", lambda: with_processes(paths, shm_path, block_bytes, p))
        for t in (int(x) for x in args.threads.split(",") if x):
            measure(f"threads={t}", lambda: with_threads(paths, buffer, block_bytes, t))
            measure(f"threads={t} no-verify",
                    lambda: with_threads(paths, buffer, block_bytes, t, verify=False))
            with busy_python_thread():
                measure(f"threads={t} +busy", lambda: with_threads(paths, buffer, block_bytes, t))
    finally:
        buffer.release()
        region.close()
        os.unlink(shm_path)


if __name__ == "__main__":
    main()
