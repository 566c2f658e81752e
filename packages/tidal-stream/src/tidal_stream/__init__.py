"""tidal-stream."""

from tidal_stream.__about__ import __version__
from tidal_stream.errors import StreamError

__all__ = ["__version__", "StreamError"]
