"""tools/bench_accuracy.py's pieces: scoring, prompt layout, options (no engine), and one
small run of the tool on a real engine."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_accuracy  # noqa: E402


def test_wilson_interval():
    lo, hi = bench_accuracy.wilson(80, 100)
    assert lo == pytest.approx(0.7112, abs=1e-3) and hi == pytest.approx(0.8666, abs=1e-3)
    assert bench_accuracy.wilson(0, 10)[0] == 0.0 and bench_accuracy.wilson(10, 10)[1] == 1.0
    assert bench_accuracy.wilson(0, 0) == (0.0, 1.0)


def test_topk_kl_is_zero_for_the_same_distribution_and_grows_with_difference():
    p = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.05)}
    assert bench_accuracy.topk_kl(p, p) == pytest.approx(0.0, abs=1e-12)
    q_near = {1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.05)}
    q_far = {2: math.log(0.7), 3: math.log(0.2), 4: math.log(0.05)}  # token 1 missing
    assert 0 < bench_accuracy.topk_kl(p, q_near) < bench_accuracy.topk_kl(p, q_far)
    exact = sum(pi * math.log(pi / qi) for pi, qi in [(0.7, 0.6), (0.2, 0.3), (0.05, 0.05)])
    assert bench_accuracy.topk_kl(p, q_near) == pytest.approx(exact, abs=1e-9)  # same rest


def test_rank_correct_needs_a_strict_winner():
    assert bench_accuracy.rank_correct([-3.0, -1.0, -2.0], 1)
    assert not bench_accuracy.rank_correct([-1.0, -1.0, -2.0], 1)  # a tie is a miss
    assert not bench_accuracy.rank_correct([-0.5, -1.0], 1)


def test_doc_region_counts_markers_and_padding_as_document_tokens():
    ssep, pdep, pad = 3, 4, 5
    final = [1, 9, pad, pad, ssep, 20, 21, pad, ssep, 30, pad, pad, pdep, 40, 41]
    header, docs = bench_accuracy.doc_region(final, [20, 21], task_len=3,
                                             markers=frozenset({ssep, pdep}))
    assert (header, docs) == (4, 8)
    with pytest.raises(ValueError, match="first document"):
        bench_accuracy.doc_region(final, [77], 3, frozenset({ssep, pdep}))


def test_unknown_method_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_accuracy.parse_args(["--methods", "stock,nope", "--model", "/m"])
    assert "unknown method" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["block_attention", "prompt_cache"])
def test_span_prompt_is_the_stock_prompt_plus_markers_and_padding(smollm2_model, method):
    """Stock and a span recipe see the same text: only markers and padding differ."""
    from transformers import AutoTokenizer

    from minipic.devtools.smollm2 import smollm2_protocol
    from minipic.devtools.synthetic_qa import make_questions
    from minipic.protocol import SpanProtocol

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    protocol = SpanProtocol.from_dict(smollm2_protocol())
    q = make_questions(1)[0]
    stock = bench_accuracy.build_prompt("stock", None, q, tokenizer, protocol, 32)
    span = bench_accuracy.build_prompt(method, bench_accuracy.METHODS[method], q, tokenizer,
                                       protocol, 32)
    noise = {protocol.ssep_token_id, protocol.pdep_token_id, protocol.pad_token_id}
    assert [t for t in span["final"] if t not in noise] == stock["final"]
    assert span["header_len"] % 32 == 0 and span["doc_len"] >= stock["doc_len"]
    assert tokenizer.decode(stock["final"]).endswith(q.answer_prefix)


@pytest.mark.engine
@pytest.mark.real_model
def test_tool_runs_and_gets_the_hits_it_expects(smollm2_model, tmp_path):
    """Two questions through a real minipic engine: files written, every final prompt
    cached exactly as SpanPrompt.expected_cached_tokens says."""
    subprocess.run([sys.executable, str(REPO / "tools" / "bench_accuracy.py"), "--questions",
                    "2", "--methods", "block_attention", "--out", str(tmp_path), "--model",
                    smollm2_model], check=True, timeout=600)
    summary = json.loads((tmp_path / "accuracy-2-block_attention.json").read_text())["methods"]
    assert summary["block_attention"]["cached_equals_expected"] == [2, 2]
    assert summary["block_attention"]["doc_cache_fraction"] == 1.0
    assert (tmp_path / "accuracy-2-block_attention.md").read_text().startswith(
        "# Accuracy: 2 questions")


def _record(qid: int, match: bool) -> dict:
    return {"id": qid, "kind": "capital", "gold": "x", "answer": "x" if match else "y",
            "match": match, "scores": [0.0], "rank_correct": match, "answer_doc": 0,
            "topk": [[1, -0.1], [2, -2.5]], "num_cached": 0, "expected_cached": None,
            "prompt_len": 10, "header_len": 2, "doc_len": 8}


def test_report_only_compares_methods_on_the_questions_both_answered(tmp_path):
    """A run cut short (one method complete, another partial, its last line cut by the
    kill) is summarised over the questions every method answered, never mixing sizes."""
    stock = [_record(i, i % 2 == 0) for i in range(6)]
    with gzip.open(tmp_path / "records-stock.jsonl.gz", "wt") as out:
        out.write("".join(json.dumps(r) + "\n" for r in stock))
    partial = tmp_path / "records-epic.partial.jsonl.gz"
    with gzip.open(partial, "wt") as out:
        for i in range(5):  # flushed after each batch, as the tool does
            out.write(json.dumps(_record(i, True)) + "\n")
            out.flush()
            if i == 3:
                four = partial.stat().st_size
    partial.write_bytes(partial.read_bytes()[:four + 4])  # the kill cut the stream in record 4
    assert len(bench_accuracy.read_records(tmp_path / "records-epic.partial.jsonl.gz")) == 4
    bench_accuracy.main(["--questions", "6", "--methods", "stock,epic", "--out", str(tmp_path),
                         "--report-only", "--model", "unused"])
    summary = json.loads((tmp_path / "accuracy-4-stock-epic.json").read_text())
    assert summary["meta"]["questions"] == 4 and summary["meta"]["asked"] == 6
    assert summary["methods"]["stock"]["exact_match"] == 0.5
    assert summary["methods"]["epic"]["exact_match"] == 1.0


def test_records_after_a_cut_member_are_read(tmp_path):
    """A run killed mid-stream, then resumed by an older writer that appended a new gzip
    member after the cut one: both runs' whole records are read."""
    path = tmp_path / "records-epic.partial.jsonl.gz"
    with gzip.open(path, "wt") as out:
        for i in range(4):
            out.write(json.dumps(_record(i, True)) + "\n")
            out.flush()
            if i == 2:
                three = path.stat().st_size
    path.write_bytes(path.read_bytes()[:three + 4])  # the kill cut record 3
    with gzip.open(path, "at") as out:  # the resumed run's member
        out.write("".join(json.dumps(_record(i, True)) + "\n" for i in range(3, 6)))
    assert [r["id"] for r in bench_accuracy.read_records(path)] == [0, 1, 2, 3, 4, 5]


def test_every_member_of_a_long_resumed_run_is_read(tmp_path):
    """Whole members, the first longer than the reader's chunk: the next member was looked
    for where the last chunk ended, not where the member did, and the rest was lost (a
    500-question run read back as 384)."""
    import random

    rng = random.Random(0)
    path = tmp_path / "records-epic.jsonl.gz"
    for lo, hi in ((0, 300), (300, 320)):  # a run, then its --resume
        with gzip.open(path, "at") as out:
            for i in range(lo, hi):
                record = _record(i, True)
                record["scores"] = [rng.random() for _ in range(20)]  # compresses poorly
                out.write(json.dumps(record) + "\n")
    assert [r["id"] for r in bench_accuracy.read_records(path)] == list(range(320))


def test_a_shorter_run_reuses_a_longer_runs_records(tmp_path, monkeypatch):
    """--resume with fewer questions than stock's file holds: stock is not run again (its
    500 records used to be replaced by a new run of 200)."""
    for name, n in (("records-stock.jsonl.gz", 6), ("records-epic.jsonl.gz", 4)):
        with gzip.open(tmp_path / name, "wt") as out:
            out.write("".join(json.dumps(_record(i, i % 2 == 0)) + "\n" for i in range(n)))

    def no_run(*args):
        raise AssertionError("a method with every asked question answered was run again")

    monkeypatch.setattr(bench_accuracy, "run_child", no_run)
    bench_accuracy.main(["--questions", "4", "--methods", "stock,epic", "--out", str(tmp_path),
                         "--resume", "--model", "unused"])
    summary = json.loads((tmp_path / "accuracy-4-stock-epic.json").read_text())
    assert summary["meta"]["questions"] == 4
    assert len(bench_accuracy.read_records(tmp_path / "records-stock.jsonl.gz")) == 6


def test_two_runs_with_one_tag_keep_both_summaries(tmp_path):
    """stock,epic2 and stock,block_attention with the same --tag: each summary is named by
    its methods (the second used to overwrite the first)."""
    for name in ("stock", "epic2-sink", "block_attention-sink"):  # stock's file has no tag
        with gzip.open(tmp_path / f"records-{name}.jsonl.gz", "wt") as out:
            out.write("".join(json.dumps(_record(i, name == "epic2")) + "\n" for i in range(3)))
    for methods in ("stock,epic2", "stock,block_attention"):
        bench_accuracy.main(["--questions", "3", "--methods", methods, "--tag", "sink",
                             "--out", str(tmp_path), "--report-only", "--model", "unused"])
    first = json.loads((tmp_path / "accuracy-3-stock-epic2-sink.json").read_text())
    second = json.loads((tmp_path / "accuracy-3-stock-block_attention-sink.json").read_text())
    assert set(first["methods"]) == {"stock", "epic2"}
    assert set(second["methods"]) == {"stock", "block_attention"}


def test_a_longer_run_continues_a_finished_shorter_one(tmp_path):
    """--resume for 500 questions after a finished 200-question run keeps its records (it
    used to read the partial file only, and start again from question 0)."""
    records = tmp_path / "records-epic2.jsonl.gz"
    with gzip.open(records, "wt") as out:
        out.write("".join(json.dumps(_record(i, True)) + "\n" for i in range(3)))
    with gzip.open(bench_accuracy.partial_path(records), "wt") as out:  # a later run, cut
        out.write("".join(json.dumps(_record(i, False)) + "\n" for i in (2, 3)))
    kept = bench_accuracy.resumed_records(records)
    assert [r["id"] for r in kept] == [0, 1, 2, 3]
    assert [r["match"] for r in kept] == [True, True, False, False]  # the partial is newer
