"""GPU tests: which path each span batch took, counted in an engine running in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as plugin_site sets it)."""

from __future__ import annotations


def count_span_paths() -> dict:
    """Count the layer calls of each span path, and the batches whose plans share rows
    between requests (the engine runs in this process)."""
    from minipic.attention import cuda_backend, graph_rows, segment_plan

    calls = {"rows": 0, "kernel": 0, "shared_plans": 0, "graph_span_steps": 0,
             "graph_prefill_steps": 0}
    fill = graph_rows.GraphRows.fill

    def counted_fill(self, shape, plan, *args, **kwargs):
        calls["graph_span_steps"] += plan is not None  # a full graph replayed a span batch
        calls["graph_prefill_steps"] += plan is not None and shape.prefill  # a question
        return fill(self, shape, plan, *args, **kwargs)

    graph_rows.GraphRows.fill = counted_fill
    for name, path in (("segment_attention", "rows"), ("unified_attention_rope", "kernel")):
        original = getattr(cuda_backend, name)

        def counted(*args, _original=original, _path=path, **kwargs):
            calls[_path] += 1
            return _original(*args, **kwargs)

        setattr(cuda_backend, name, counted)
    shared = segment_plan._shared

    def counted_shared(rows, *args, **kwargs):
        merged = shared(rows, *args, **kwargs)
        calls["shared_plans"] += merged.row_request.size < rows.row_request.size
        return merged

    segment_plan._shared = counted_shared
    return calls
