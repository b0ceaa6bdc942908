"""MiniPICConnector with real CPU engines in real processes (issue 4, tests 1-5).

Span prompts are built by hand from the tiny model's vocabulary: markers are
its reserved tokens (SSep 3, PDep 4, pad 5), block size 32:

    span  = [SSep] + words, padded to a block      (prefilled alone first)
    final = [system][span a][span b] [PDep task]   (spans hit wherever they sit)

Engine A (one process) prefills the spans alone, then answers the final
prompts from GPU-resident hits, writing every span block to its store; each
later engine is a fresh process that must reproduce A's tokens from the store.

A child engine spends most of its time starting up (three processes importing vLLM, one
after the other, each on one core), so the module runs its children two at a time in the
background (`Runs`), in the order the tests read them, each run once the runs whose store
it reads have ended; a test waits for the runs it checks. Every run is still a fresh
process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import api_server

from minipic.config import connector_config

pytestmark = pytest.mark.engine

SSEP, PDEP, PAD, BS = 3, 4, 5, 32
CHILD = str(Path(__file__).with_name("engine_child.py"))
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _prompts() -> dict:
    rng = random.Random(0)

    def words(n):
        return [rng.randrange(10, 300) for _ in range(n)]

    def span(n):
        t = [SSEP] + words(n)
        return t + [PAD] * (-len(t) % BS)

    p = {"system": words(32), "system2": words(64),
         "docs": [span(40), span(50), span(45)], "task": [PDEP] + words(9),
         "stress": [span(70) for _ in range(6)]}
    d0, d1, d2 = p["docs"]
    p["finals"] = {"final": p["system"] + d0 + d1 + p["task"],
                   "swapped": p["system"] + d1 + d0 + p["task"],
                   "shifted": p["system2"] + d2 + d1 + d0 + p["task"]}
    p["spans"] = [p["system"], p["system2"], *p["docs"]]
    return p


P = _prompts()
FINAL_NAMES = list(P["finals"])
FINALS = list(P["finals"].values())
# Every block before the PDep task is a span block: all of it can hit.
FULL_HITS = [len(f) - len(P["task"]) for f in FINALS]
SPAN_BLOCKS = sum(len(s) // BS for s in P["spans"])
STRESS_BLOCKS = sum(len(s) // BS for s in P["stress"])


def _burst() -> list[list[int]]:
    rng = random.Random(1)
    return [[SSEP] + [rng.randrange(10, 300) for _ in range(95)] for _ in range(40)]


def _churn() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(10, 300) for _ in range(2 * BS)] for _ in range(12)]  # no markers


BURST, CHURN = _burst(), _churn()


def extra_config(store: Path, **more) -> dict:
    # One reader process: loads take the path GPU hosts use (small hosts default to threads,
    # which tests/connector/test_disk_tier.py covers).
    return {"store_dir": str(store), "cpu_bytes": 64 << 20, "ssep_token_id": SSEP,
            "pdep_token_id": PDEP, "pad_token_id": PAD, "disk_read_processes": 1, **more}


def start_engine(tmp: Path, name: str, model: str, store: Path, steps: list,
                 in_process: bool = False, **extra) -> tuple:
    plan = tmp / f"{name}.plan.json"
    plan.write_text(json.dumps({"model": model, "extra_config": extra_config(store, **extra),
                                "steps": steps, "in_process": in_process,
                                "log": str(tmp / f"{name}.log")}))
    out, log = tmp / f"{name}.out.json", open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, CHILD, str(plan), str(out)], env=ENV,
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, out, tmp / f"{name}.log"


def finish(engine: tuple, timeout: float = 600) -> dict:
    proc, out, log = engine
    rc = proc.wait(timeout)
    assert rc == 0, f"engine failed (rc={rc}); log tail:\n" + log.read_text()[-4000:]
    return json.loads(out.read_text())["results"]


class Runs:
    """Child engines run in the background, two processes at a time, started in the order
    added (one that does not fit yet lets a later one go first), each once the runs named in
    its `after` have ended. `result(name)` waits for a run's results. A test that runs an
    engine of its own in the foreground holds one of the two places meanwhile."""

    WIDTH = 2
    RUN_TIMEOUT_S = 600  # per run, as finish() allows one

    def __init__(self, world: dict):
        self._world = world
        self._queue: list[dict] = []
        self._running: list[dict] = []
        self._done: dict[str, dict] = {}
        self._foreground = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="engine-runs", daemon=True)
        self._thread.start()

    def add(self, name: str, start, after: tuple = (), width: int = 1) -> None:
        """`start(world)` starts the run's engines (start_engine's tuples, a list of them for
        several) and returns them."""
        with self._cond:
            self._queue.append({"name": name, "start": start, "after": after, "width": width})
            self._cond.notify_all()

    def result(self, name: str):
        """finish()'s results of the run's engine (a list of them for several); what failed
        in the run (start-up, exit status) is raised here."""
        with self._cond:
            assert name in self._done or any(r["name"] == name
                                              for r in self._queue + self._running), name
            while name not in self._done:
                assert self._thread.is_alive(), "the thread that runs the engines died"
                self._cond.wait(1)
            run = self._done[name]
        if run["error"] is not None:
            raise run["error"]
        return run["results"]

    @contextlib.contextmanager
    def foreground(self):
        """Waits for a place (a run to end, if two are running), and holds it."""
        with self._cond:
            self._foreground += 1  # no run starts meanwhile
            while self._foreground + sum(r["width"] for r in self._running) > self.WIDTH:
                assert self._thread.is_alive(), "the thread that runs the engines died"
                self._cond.wait(1)
        try:
            yield
        finally:
            with self._cond:
                self._foreground -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for run in self._running:
                for proc, _, _ in run["engines"]:
                    proc.kill()
                    proc.wait()
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                self._reap()
                self._start_ready()
                self._cond.wait(0.2)

    def _end(self, run: dict, results=None, error: BaseException | None = None) -> None:
        run.update(results=results, error=error)
        self._done[run["name"]] = run
        self._cond.notify_all()

    def _reap(self) -> None:
        for run in list(self._running):
            overdue = time.monotonic() > run["deadline"]
            if not overdue and any(proc.poll() is None for proc, _, _ in run["engines"]):
                continue
            self._running.remove(run)
            if overdue:
                for proc, _, _ in run["engines"]:
                    proc.kill()
                    proc.wait()
                self._end(run, error=TimeoutError(f"run {run['name']} did not end in "
                                                  f"{self.RUN_TIMEOUT_S} s"))
                continue
            try:
                results = [finish(engine, timeout=0) for engine in run["engines"]]
            except BaseException as e:  # noqa: BLE001 (the test that reads it raises it)
                self._end(run, error=e)
            else:
                self._end(run, results if run["several"] else results[0])

    def _start_ready(self) -> None:
        for run in list(self._queue):
            failed = [a for a in run["after"] if a in self._done and self._done[a]["error"]]
            if failed:
                self._queue.remove(run)
                self._end(run, error=RuntimeError(f"run {failed[0]} failed"))
                continue
            used = self._foreground + sum(r["width"] for r in self._running)
            if any(a not in self._done for a in run["after"]) or \
                    used + run["width"] > self.WIDTH:
                continue
            self._queue.remove(run)
            try:
                engines = run["start"](self._world)
            except BaseException as e:  # noqa: BLE001
                self._end(run, error=e)
                continue
            run["several"] = isinstance(engines, list)
            run["engines"] = engines if run["several"] else [engines]
            run["deadline"] = time.monotonic() + self.RUN_TIMEOUT_S
            self._running.append(run)


def gen(name: str, prompts: list, max_tokens: int = 8) -> dict:
    return {"op": "generate", "name": name, "prompts": prompts, "max_tokens": max_tokens}


def store_stats(store: Path):
    from minipic.connector.store.stats import scan_store

    [ns] = scan_store(store)
    return ns


def assert_store_clean(store: Path) -> None:
    from minipic.cli import main

    assert main(["store", "verify", str(store)]) == 0


def start_a(w: dict) -> tuple:
    return start_engine(w["tmp"], "A", w["model"], w["store"], [
        gen("spans", P["spans"], max_tokens=1),
        gen("finals", FINALS),
        {"op": "wait_store", "blocks": SPAN_BLOCKS},  # the last offloads reached the disk
    ])


def start_b(w: dict) -> tuple:
    """Engine B: a fresh process on A's store, asked the final prompts only."""
    return start_engine(w["tmp"], "B", w["model"], w["store"], [gen("finals", FINALS)])


def start_c(w: dict) -> tuple:
    """Engine C, on a copy of A's store whose span heads are damaged."""
    from minipic.connector.store import block_file

    store = w["tmp"] / "store-c"
    shutil.copytree(w["store"], store)
    from minipic.connector.store.eviction import iter_blocks

    # The first block of each doc (2 blocks each): the one a doc's own prefill loads.
    heads = sorted(b.path for b in iter_blocks(store)
                   if block_file.read_header(b.path)["flags"] & block_file.FLAG_SPAN_HEAD)
    assert len(heads) == 3
    data = bytearray(Path(heads[0]).read_bytes())
    data[-5] ^= 0xFF
    Path(heads[0]).write_bytes(bytes(data))                          # corrupt payload
    Path(heads[1]).write_bytes(Path(heads[1]).read_bytes()[:-64])    # truncated
    fields = block_file.read_header(heads[2])
    payload = Path(heads[2]).read_bytes()[block_file.HEADER_LEN:]
    Path(heads[2]).write_bytes(                                      # another configuration's
        block_file.encode_header(b"\x01" * 16, fields["key"], payload) + payload)

    return start_engine(w["tmp"], "C", w["model"], store, [
        gen("spans", P["spans"], max_tokens=1), gen("finals", FINALS)])


def start_replicas(w: dict) -> list:
    """P and Q, two engines at once on one store."""
    tmp, store = w["tmp"], w["tmp"] / "store-shared"
    sig = {n: str(tmp / f"sig-{n}") for n in ("p_up", "q_up", "p_spans")}
    p = start_engine(tmp, "P", w["model"], store, [
        {"op": "touch", "path": sig["p_up"]}, {"op": "wait", "path": sig["q_up"]},
        gen("stress", P["stress"], max_tokens=1),          # same spans as Q, at once
        gen("spans", P["spans"], max_tokens=1),
        {"op": "wait_store", "blocks": STRESS_BLOCKS + SPAN_BLOCKS},  # P's spans on disk
        {"op": "touch", "path": sig["p_spans"]},
    ])
    q = start_engine(tmp, "Q", w["model"], store, [
        {"op": "touch", "path": sig["q_up"]}, {"op": "wait", "path": sig["p_up"]},
        gen("stress", P["stress"], max_tokens=1),
        {"op": "wait", "path": sig["p_spans"]},
        gen("finals", FINALS),                             # spans only P computed
        gen("stress_again", P["stress"], max_tokens=1),
    ])
    return [p, q]


def start_small_tier(w: dict) -> tuple:
    return start_engine(w["tmp"], "small-tier", w["model"], w["tmp"] / "store-small-tier",
                        [gen("burst", BURST, max_tokens=1)],
                        cpu_bytes=8 * 32 << 10)  # 8 blocks of this model (32 KiB each)


def start_big_tier(w: dict) -> tuple:
    # What the warning asks for: two steps of this engine (4096 batched tokens) = 256 blocks.
    return start_engine(w["tmp"], "big-tier", w["model"], w["tmp"] / "store-big-tier",
                        [gen("burst", BURST, max_tokens=1)], cpu_bytes=512 * 32 << 10)


def start_no_copy_back(w: dict) -> tuple:
    return start_engine(w["tmp"], "no-copy-back", w["model"], w["tmp"] / "store-no-copy-back", [
        gen("spans", P["spans"], max_tokens=1),
        {"op": "wait_store", "blocks": SPAN_BLOCKS},  # on disk before the churn evicts them
        *[gen(f"churn{i}", CHURN[i:i + 4], max_tokens=1) for i in range(0, 12, 4)],
        gen("finals", FINALS), {"op": "sleep", "seconds": 1}],  # time for a copy-back to show
        cpu_bytes=16 * 32 << 10)  # 16 blocks of this model: the churn evicts the spans


def start_idle(w: dict) -> tuple:
    return start_engine(w["tmp"], "idle", w["model"], w["tmp"] / "store-idle", [
        {"op": "stall_disk_writes"}, gen("spans", P["spans"], max_tokens=1),
        {"op": "idle_check", "name": "idle"}, {"op": "release_disk_writes"}],
        in_process=True)


def start_lost(w: dict) -> tuple:
    store = w["tmp"] / "store-lost"
    return start_engine(w["tmp"], "lost", w["model"], store, [
        gen("spans", P["spans"], max_tokens=1), {"op": "wait_store", "blocks": SPAN_BLOCKS},
        {"op": "cli", "args": ["store", "evict", str(store), "--max-bytes", "0"]},
        # the engine checks for removals every second
        {"op": "wait_log", "text": "believed stored are gone from"},
        gen("again", P["spans"], max_tokens=1), {"op": "wait_store", "blocks": SPAN_BLOCKS}])


# Every run but A, in the order started, with the tests that read it.
RUNS = [
    ("small-tier", start_small_tier, (), 1, "test_a_burst_the_cpu_tier_holds_is_persisted_whole"),
    ("B", start_b, ("A",), 1, "test_restart_serves_spans_from_disk"),
    ("B", start_b, ("A",), 1, "test_spans_load_at_other_offsets"),
    ("C", start_c, ("A",), 1, "test_bad_files_are_skipped_and_recomputed"),
    ("replicas", start_replicas, (), 2, "test_replicas_share_one_store"),
    ("big-tier", start_big_tier, (), 1, "test_a_burst_the_cpu_tier_holds_is_persisted_whole"),
    ("no-copy-back", start_no_copy_back, (), 1,
     "test_gpu_hits_on_stored_spans_are_not_copied_back"),
    ("idle", start_idle, (), 1, "test_the_engine_idles_while_only_disk_writes_are_in_flight"),
    ("lost", start_lost, (), 1, "test_spans_the_store_lost_are_written_back"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, request):
    from minipic.devtools.tiny_llama import build_tiny_llama

    tmp = tmp_path_factory.mktemp("connector")
    model = str(build_tiny_llama(tmp / "model"))
    w = {"tmp": tmp, "model": model, "store": tmp / "store-a"}
    w["runs"] = runs = Runs(w)
    # The runs of the tests selected (all of them, unless a test was picked out).
    selected = {item.name for item in request.session.items
                if getattr(item, "module", None) is request.module}
    runs.add("A", start_a)
    added = {"A"}
    for name, start, after, width, test in RUNS:
        if test in selected and name not in added:
            runs.add(name, start, after, width)
            added.add(name)
    try:
        w["a"] = runs.result("A")
        yield w
    finally:
        runs.close()


@pytest.fixture(scope="module")
def restarted(world):
    """Engine B: a fresh process on A's store, asked the final prompts only."""
    return world["runs"].result("B")


def test_a_serves_finals_from_gpu_resident_spans(world):
    assert [r["cached"] for r in world["a"]["finals"]] == FULL_HITS
    ns = store_stats(world["store"])
    assert ns.spans == len(P["spans"]) - 2  # the two system prompts start no span
    assert ns.blocks == sum(len(s) // BS for s in P["spans"])


def test_restart_serves_spans_from_disk(world, restarted):
    assert [r["cached"] for r in restarted["finals"]] == FULL_HITS
    assert [r["tokens"] for r in restarted["finals"]] == [r["tokens"] for r in world["a"]["finals"]]
    assert store_stats(world["store"]).counters["hit_blocks"] > 0


def test_spans_load_at_other_offsets(world, restarted):
    """Each doc was stored from offset 0 (prefilled alone); the finals load them at
    offsets 32..160 from disk, and match A's GPU-resident hits token for token."""
    a = {name: r for name, r in zip(FINAL_NAMES, world["a"]["finals"])}
    b = {name: r for name, r in zip(FINAL_NAMES, restarted["finals"])}
    for name in FINAL_NAMES:
        assert b[name] == a[name], name
    # the same spans in another order give another answer: the test can fail
    assert a["final"]["tokens"] != a["swapped"]["tokens"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_answers_span_prompts_with_hits(world):
    store = world["tmp"] / "store-serve"
    shutil.copytree(world["store"], store)
    kv = connector_config(extra_config(store))
    log = world["tmp"] / "serve.log"
    with world["runs"].foreground(), api_server(world["model"], log, "--max-model-len", "1024",
                                                "--kv-transfer-config", json.dumps(kv)) as url:
        reply = _post(f"{url}/v1/completions", {
            "model": world["model"], "prompt": FINALS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        files = _cpu_tier_files(log)
        # Unlinked once every engine process has it mapped: not even SIGKILL can leak it.
        assert files and not [f for f in files if os.path.exists(f)]
    # The server was stopped with SIGTERM (vLLM then kills its engine): nothing left behind.
    assert not [f for f in files if os.path.exists(f)]
    assert reply["choices"][0]["token_ids"] == world["a"]["finals"][0]["tokens"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL_HITS[0]
    assert store_stats(store).counters["hit_blocks"] >= FULL_HITS[0] // BS


def test_bad_files_are_skipped_and_recomputed(world):
    """Engine C runs on a copy of A's store whose three span heads were damaged (start_c):
    a corrupt payload, a truncated file, another configuration's header."""
    store = world["tmp"] / "store-c"
    c = world["runs"].result("C")
    # bad spans were recomputed on their own, so the finals hit everything
    assert [r["cached"] for r in c["finals"]] == FULL_HITS
    assert [r["tokens"] for r in c["finals"]] == [r["tokens"] for r in world["a"]["finals"]]
    ns = store_stats(store)
    assert ns.counters["rejected_blocks"] == 3
    # The system prompts' own prefills hit the (intact) store; each doc's prefill
    # found its first block damaged and recomputed the doc.
    cached = [r["cached"] for r in c["spans"]]
    assert cached[0] > 0 and cached[1] > 0 and cached[2:] == [0, 0, 0], cached
    assert_store_clean(store)  # bad files were removed and rewritten


def test_replicas_share_one_store(world):
    store = world["tmp"] / "store-shared"
    p_results, q_results = world["runs"].result("replicas")
    assert [r["cached"] for r in q_results["finals"]] == FULL_HITS
    assert [r["tokens"] for r in q_results["finals"]] == [r["tokens"] for r in world["a"]["finals"]]
    assert p_results["stress"][0]["tokens"] == q_results["stress"][0]["tokens"]
    ns = store_stats(store)
    assert ns.counters["rejected_blocks"] == 0  # no torn or half-written file was ever seen
    assert ns.counters["hit_blocks"] >= sum(h // BS for h in FULL_HITS[:1])
    assert_store_clean(store)


def test_a_burst_the_cpu_tier_holds_is_persisted_whole(world):
    """Blocks reach the disk through the CPU tier. A burst larger than the tier loses
    stores (vLLM: 'cannot store chunks'), which minipic warns about at start-up; a tier
    that holds the burst persists every block, with no pause before shutdown."""
    tmp = world["tmp"]
    blocks = sum(len(s) // BS for s in BURST)  # 3 per span, 120 in one burst

    small, big = tmp / "store-small-tier", tmp / "store-big-tier"
    world["runs"].result("small-tier")  # a CPU tier of 8 blocks
    log = (tmp / "small-tier.log").read_text()
    assert "minipic store: the CPU tier" in log and "cannot store chunks" in log
    assert store_stats(small).blocks < blocks

    world["runs"].result("big-tier")  # 256 blocks: what the warning asks for
    log = (tmp / "big-tier.log").read_text()
    assert "minipic store: the CPU tier" not in log and "cannot store chunks" not in log
    assert store_stats(big).blocks == blocks


def test_gpu_hits_on_stored_spans_are_not_copied_back(world):
    """Spans age out of a small CPU tier but stay on the GPU and on disk: the finals' GPU hits
    must not copy them to the CPU tier again (stock offloading would, and the disk tier would
    then find every file present: duplicate_blocks counts those)."""
    store = world["tmp"] / "store-no-copy-back"
    results = world["runs"].result("no-copy-back")  # a CPU tier of 16 blocks, churned
    assert [r["cached"] for r in results["finals"]] == FULL_HITS
    assert [r["tokens"] for r in results["finals"]] == [r["tokens"] for r in world["a"]["finals"]]
    ns = store_stats(store)
    assert ns.blocks >= sum(len(s) // BS for s in P["spans"]) + 24
    assert ns.counters["duplicate_blocks"] == 0


def test_the_engine_idles_while_only_disk_writes_are_in_flight(world):
    """An in-process engine prefills the spans with their block files held back: once the
    CPU tier has them, only the tier's writes are left, and they need no engine step. vLLM's
    default is to keep stepping (a busy-poll: schedule, empty step, 1 ms sleep) until they
    end, starving them and the next request of the GIL. The held writes still land: the
    engine's shutdown waits for them."""
    store = world["tmp"] / "store-idle"
    results = world["runs"].result("idle")
    idle = results["idle"]
    assert idle["writes_waiting"] > 0 and not idle["released"]
    assert idle["idle"], f"still stepping after {idle['steps']} steps"
    ns = store_stats(store)
    assert (ns.blocks, ns.spans) == (sum(len(s) // BS for s in P["spans"]), len(P["spans"]) - 2)
    assert_store_clean(store)


def test_spans_the_store_lost_are_written_back(world):
    """A running engine holds its spans (GPU and CPU tier) and knows them stored; the store
    loses them (`minipic store evict`, as another replica's eviction or a wiped disk would).
    The next requests for them must write them back: they used to be skipped as stored."""
    tmp, store = world["tmp"], world["tmp"] / "store-lost"
    span_blocks = sum(len(s) // BS for s in P["spans"])
    results = world["runs"].result("lost")
    assert all(r["cached"] > 0 for r in results["again"])  # hits on GPU: nothing recomputed
    ns = store_stats(store)
    assert ns.blocks == span_blocks
    assert ns.counters["evicted_blocks"] == span_blocks  # the CLI's evictions count (item 10)
    assert_store_clean(store)
    assert "gone from" in (tmp / "lost.log").read_text()


def _cpu_tier_files(log: Path) -> list[str]:
    """The /dev/shm files vLLM created for an engine's CPU tier (it logs each)."""
    return sorted(set(re.findall(r"Created mmap file (/dev/shm/\S+\.mmap)", log.read_text())))


def test_a_stopped_engine_leaves_no_cpu_tier_in_dev_shm(world):
    """Normal exit (engine A); SIGTERM is test_5's server."""
    files = _cpu_tier_files(world["tmp"] / "A.log")
    assert files and not [f for f in files if os.path.exists(f)]
