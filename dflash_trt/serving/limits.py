"""The server's admission limits, defined once (the CLI's defaults and the server's)."""

DEFAULT_MAX_STREAMS = 64  # concurrent requests/streams admitted; past it RESOURCE_EXHAUSTED / HTTP 429
DEFAULT_STREAM_IDLE_TIMEOUT_S = 600.0  # a stream with no request for this long is closed
