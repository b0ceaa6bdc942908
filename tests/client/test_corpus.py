"""Reading a corpus: formats, stable ids, and every kind of bad input reported by where."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from minipic.client.preload.corpus import CorpusProblem, Document, IgnoredFile, iter_corpus


def write_corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("paris is the capital of france")
    (root / "sub" / "b.md").write_text("# berlin\nberlin is the capital of germany")
    (root / "bom.txt").write_bytes("\ufeffrome".encode("utf-8"))
    (root / "c.jsonl").write_text("\n".join([
        json.dumps({"text": "rome is in italy", "id": "r"}),
        json.dumps({"text": "madrid is in spain"}),
        "",
        json.dumps({"body": "no text field"}),
        "{not json",
        json.dumps({"text": "   "}),
    ]) + "\n")
    pq.write_table(pa.table({"text": ["tokyo", None, "london"], "id": ["t", "n", "l"]}),
                   root / "d.parquet")
    (root / "notes.csv").write_text("a,b\n")
    (root / ".hidden.txt").write_text("never read")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "empty.md").write_text("\n \n")
    pq.write_table(pa.table({"body": ["x"]}), root / "e.parquet")
    (root / "broken.parquet").write_bytes(b"PAR1 not really")
    return root


def read(root, **kwargs):
    items = list(iter_corpus(root, **kwargs))
    docs = {i.doc_id: i.text for i in items if isinstance(i, Document)}
    problems = {i.where: i.reason for i in items if isinstance(i, CorpusProblem)}
    ignored = [i.source for i in items if isinstance(i, IgnoredFile)]
    return docs, problems, ignored


def test_formats_and_ids(tmp_path):
    docs, _, ignored = read(write_corpus(tmp_path / "corpus"), id_field="id")
    assert docs == {
        "a.txt": "paris is the capital of france",
        "bom.txt": "rome",
        "c.jsonl#r": "rome is in italy",
        "c.jsonl#2": "madrid is in spain",  # no id: the line number
        "d.parquet#t": "tokyo",
        "d.parquet#l": "london",
        "sub/b.md": "# berlin\nberlin is the capital of germany",
    }
    assert ignored == ["notes.csv"]


def test_ids_without_id_field_are_record_numbers(tmp_path):
    docs, _, _ = read(write_corpus(tmp_path / "corpus"))
    assert {"c.jsonl#1", "c.jsonl#2", "d.parquet#1", "d.parquet#3"} <= set(docs)


def test_order_and_ids_are_stable(tmp_path):
    root = write_corpus(tmp_path / "corpus")
    first = [getattr(i, "doc_id", None) or str(i) for i in iter_corpus(root)]
    os.utime(root / "a.txt")  # nothing about mtime or creation order matters
    assert first == [getattr(i, "doc_id", None) or str(i) for i in iter_corpus(root)]


def test_bad_inputs_are_reported_by_where(tmp_path):
    _, problems, _ = read(write_corpus(tmp_path / "corpus"), id_field="id")
    assert problems.keys() == {"latin1.txt", "empty.md", "c.jsonl:4", "c.jsonl:5", "c.jsonl:6",
                               "d.parquet:row 2", "e.parquet", "broken.parquet"}
    assert "not UTF-8" in problems["latin1.txt"]
    assert problems["empty.md"] == "empty document"
    assert problems["c.jsonl:4"] == "no 'text' field"
    assert problems["c.jsonl:5"].startswith("not JSON")
    assert "no 'text' column" in problems["e.parquet"]
    assert "Parquet" in problems["broken.parquet"]


def test_text_field_is_configurable(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "rome"}) + "\n")
    docs, problems, _ = read(tmp_path, text_field="body")
    assert docs == {"x.jsonl#1": "rome"} and not problems


def test_duplicate_ids_keep_the_first(tmp_path):
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps({"id": "same", "text": t})
                                                for t in ("one", "two")))
    docs, problems, _ = read(tmp_path, id_field="id")
    assert docs == {"x.jsonl#same": "one"}
    assert "duplicate" in problems["x.jsonl#same"]


def test_unreadable_file_is_a_problem(tmp_path):
    (tmp_path / "gone.txt").symlink_to(tmp_path / "deleted.txt")  # unreadable, even for root
    _, problems, _ = read(tmp_path)
    assert problems["gone.txt"].startswith("cannot read")


def test_missing_corpus(tmp_path):
    _, problems, _ = read(tmp_path / "nowhere")
    assert list(problems.values()) == ["no such file or directory"]


def test_a_single_file_is_a_corpus(tmp_path):
    (tmp_path / "one.md").write_text("rome")
    docs, _, _ = read(tmp_path / "one.md")
    assert docs == {"one.md": "rome"}


def test_linked_directories_are_read_once_and_loops_end(tmp_path):
    root = tmp_path / "corpus"
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "x.txt").write_text("a linked document")
    root.mkdir()
    (root / "top.txt").write_text("top")
    (root / "linked").symlink_to(tmp_path / "real")
    (root / "loop").symlink_to(root)  # back to the root
    docs, problems, _ = read(root)
    assert docs == {"top.txt": "top", "linked/x.txt": "a linked document"} and not problems


def test_a_parquet_file_without_the_id_column_is_a_problem(tmp_path):
    pq.write_table(pa.table({"text": ["tokyo"]}), tmp_path / "d.parquet")
    docs, problems, _ = read(tmp_path, id_field="id")
    assert not docs and "no 'id' column" in problems["d.parquet"]
