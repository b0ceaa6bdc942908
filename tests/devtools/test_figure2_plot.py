"""Figure 2's title and series names: the run's facts and the names users know."""

from minipic.devtools.figure2_plot import phase_label, run_facts


def test_phases_get_the_names_users_know():
    stock = "stock vLLM (FA3)"
    assert phase_label("stock", stock) == "stock vLLM (FA3), full prefill"
    assert phase_label("gpu-hit", stock) == "minipic, GPU hit"
    assert phase_label("disk-warm-t16-p16", stock) == \
        "minipic, from disk (page cache warm; 16 threads, 16 processes)"
    assert phase_label("disk-cold-t4", stock) == \
        "minipic, from disk (page cache dropped; 4 threads)"


def test_facts_of_a_run_and_of_runs_merged_per_part():
    flat = {"args": {"arch": "llama3-8b", "eager": False},
            "host": {"python": "3.12", "gpu": "NVIDIA H200\nNVIDIA H200", "vllm": "0.25.1",
                     "stock_attention": "FA3"}}
    assert run_facts(flat) == {"model": "Llama-3-8B shape (dummy weights, bf16)",
                               "gpu": "NVIDIA H200", "vllm": "0.25.1",
                               "mode": "compiled (CUDA graphs)", "stock_attention": "FA3"}
    merged = {"args": {"ttft": {"arch": "tiny", "eager": True}},
              "host": {"ttft": {"python": "3.11", "gpu": None}}}
    facts = run_facts(merged, vllm="0.32.0")
    assert (facts["gpu"], facts["vllm"], facts["mode"], facts["stock_attention"]) == \
        ("CPU", "0.32.0", "eager", "?")  # unrecorded and not given: shown as unknown
