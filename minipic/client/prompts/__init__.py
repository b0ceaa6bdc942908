"""Building span prompts: the markers, padding and prefill requests of each recipe
(span_prompt, recipes, prompt_cache), how documents are cut into spans
(document_spans), and how many tokens a final prompt should hit (expected_hits)."""
