"""minipic: position-independent caching for stock vLLM, as a plugin."""

from minipic.config import CONFIG_KEY, CONNECTOR_NAME
from minipic.protocol import SpanProtocol, SpanProtocolError

__version__ = "0.1.0"
# Bumped whenever hashing or the stored KV format changes: part of the
# connector's store namespace, so old stores are never misread.
FORMAT_VERSION = 1

__all__ = ["CONFIG_KEY", "CONNECTOR_NAME", "FORMAT_VERSION", "SpanProtocol",
           "SpanProtocolError", "__version__"]
