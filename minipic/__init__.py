"""minipic: position-independent caching for stock vLLM, as a plugin."""

from minipic.config import CONFIG_KEY, CONNECTOR_NAME
from minipic.protocol import SpanProtocol, SpanProtocolError

__version__ = "0.1.0"

__all__ = ["CONFIG_KEY", "CONNECTOR_NAME", "SpanProtocol", "SpanProtocolError", "__version__"]
