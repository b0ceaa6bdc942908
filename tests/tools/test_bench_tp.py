"""tools/bench_tp.py without a GPU: its arguments, prompts, checkpoint names and comparison
math (the engines themselves run on the H200 host)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_tp  # noqa: E402


def test_arguments_default_to_both_shapes_and_every_phase():
    args = bench_tp.parse_args(["--out", "/tmp/tp"])
    assert args.shapes == ["llama3-8b", "llama3-70b-4l"]
    assert args.phases == ["tp1", "tp2", "tp2-reload"]


@pytest.mark.parametrize("argv", [["--shapes", "llama3-405b"], ["--phases", "tp2"], []])
def test_bad_arguments_stop_at_parsing(argv, capsys):
    with pytest.raises(SystemExit):
        bench_tp.parse_args(argv + (["--out", "/tmp/tp"] if argv else []))
    assert "error" in capsys.readouterr().err


def test_prompts_put_documents_at_new_offsets_and_expect_their_hits():
    p = bench_tp.build_prompts(docs=4, doc_tokens=200, finals=2)
    assert p == bench_tp.build_prompts(docs=4, doc_tokens=200, finals=2)  # every process alike
    span = 13 * bench_tp.BLOCK_SIZE  # SSep + 200 tokens, padded
    header = 4 * bench_tp.BLOCK_SIZE  # the 64-token system prompt (no tokenizer, no BOS)
    assert len(p["prefills"]) == 5 and all(len(s) % bench_tp.BLOCK_SIZE == 0
                                           for s in p["prefills"])
    assert [f["recipe"] for f in p["finals"]] == ["block_attention"] * 2 + ["epic"] * 2
    for final in p["finals"] + p["probes"]:
        assert final["expected_cached"] == header + 4 * span  # links and question computed
        assert final["expected_rerun"] == (len(final["tokens"]) - 1) // 16 * 16
    first, second = (f["tokens"] for f in p["finals"][:2])
    doc_at = lambda prompt, k: prompt[header + k * span:header + (k + 1) * span]  # noqa: E731
    assert all(doc_at(first, k) != doc_at(second, k) for k in range(4))  # all moved
    probes = {tuple(f["tokens"]) for f in p["probes"]}
    assert not probes & {tuple(f["tokens"]) for f in p["finals"]}


def test_compare_stops_at_the_first_different_token():
    a = [{"tokens": [1, 2, 3], "lp": [-0.5, -1.0, -2.0]}, {"tokens": [4, 5], "lp": [-0.1, -0.2]}]
    b = [{"tokens": [1, 2, 9], "lp": [-0.5, -1.25, -0.1]}, {"tokens": [4, 5], "lp": [-0.1, -0.2]}]
    assert bench_tp.compare(a, b) == {"max_abs_logprob_diff": 0.25, "compared_tokens": 4,
                                      "diverged_prompts": 1, "prompts": 2}
    assert bench_tp.compare(a, a)["max_abs_logprob_diff"] == 0.0
    with pytest.raises(ValueError):
        bench_tp.compare(a, b[:1])


def test_checkpoint_names_and_shapes_are_hf_llamas():
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      vocab_size=300, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    hf = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert bench_tp.checkpoint_shapes(config) == hf


def test_the_70b_shape_has_70bs_width_and_heads(tmp_path):
    config = json.loads((Path(bench_tp.model_dir("llama3-70b-4l", tmp_path)) /
                         "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["num_hidden_layers"]) == (8192, 64, 8, 4)


def test_summary_and_markdown_from_engine_results():
    p = bench_tp.build_prompts(docs=2, doc_tokens=40, finals=1)
    out = lambda lp, cached: [{"tokens": [7, 8], "lp": [lp, -1.0], "cached_tokens": c}  # noqa
                              for c in cached]
    expected = [f["expected_cached"] for f in p["finals"]]
    rerun = [f["expected_rerun"] for f in p["finals"]]
    ns = [{"namespace": "ns-a", "tp": 1, "blocks": 9, "loaded_blocks": 0}]
    report = bench_tp.summarise({"shape": "llama3-8b", "phases": {
        "tp1": {"finals": out(-0.5, expected), "namespaces_after": ns},
        "tp2": {"finals": out(-0.53, expected), "probe": out(-0.5, [0, 0]),
                "namespaces_after": ns},
        "tp2-reload": {"finals": out(-0.52, rerun), "namespaces_after": ns},
    }}, p["finals"])
    assert report["tp2_vs_tp1"]["max_abs_logprob_diff"] == pytest.approx(0.03)
    assert all(report["phases"][ph]["hits"]["all_hit"] for ph in bench_tp.PHASES)
    assert report["phases"]["tp2"]["probe_cached_tokens"] == [0, 0]
    assert bench_tp.headline([report]) == pytest.approx(0.03)
    assert "| llama3-8b | tp2 |" in bench_tp.markdown([report])
