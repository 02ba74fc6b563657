"""Admission limits of the serving front, defined once (the CLI's defaults and the front's), in a
module light enough for `dflash-trt --help` (the front itself imports Starlette)."""

DEFAULT_MAX_STREAMS = 64  # requests in flight through the OpenAI front; past it HTTP 429
