"""Preloading a corpus into the span store: reading it (corpus), cutting and prefilling
its spans (pipeline: the library, any backend), recording them (manifest), and the
`minipic-preload` command around them (cli)."""
