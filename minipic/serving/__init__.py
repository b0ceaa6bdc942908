"""API server side of minipic: span prompts the server builds itself, its settings route,
and its preload route (documents' spans prefilled from text).

Runs in vLLM's OpenAI API server process (the front end), through the patches in
minipic/_vllm_patches.py; nothing here runs in the engine core or workers.
"""
