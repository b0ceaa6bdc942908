"""Serving RAG requests over cached spans: the client (client), one request and its
result (request), and the two scheduling strategies, ISPS (isps) and its barrier
baseline (barrier)."""
