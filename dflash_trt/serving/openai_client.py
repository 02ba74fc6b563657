"""`dflash-trt client http://host:port ...`: one request to an OpenAI-compatible server (ours,
`vllm serve`, `trtllm-serve`) through the `openai` package, as a chat turn (the prompt is one user
message, as the gRPC client's text_input_format "user"), or with `raw` as a completion of the raw
prompt. Returns the same ClientResult as the gRPC client; the DFlash statistics come from the
`dflash` object our server adds (absent elsewhere: then empty)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from dflash_trt.errors import DFlashError
from dflash_trt.serving.client import ClientResult


def _stats(extra: dict[str, Any] | None, usage: Any) -> dict[str, Any]:
    stats = dict((extra or {}).get("dflash") or {})
    if usage is not None:
        stats["num_output_tokens"] = usage.completion_tokens
    return stats


def generate_openai(url: str, prompt: str, model: str = "dflash", stream: bool = False,
                    on_text: Callable[[str], None] | None = None, timeout_s: float = 300.0,
                    max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                    seed: int | None = None, stop: Sequence[str] = (), raw: bool = False) -> ClientResult:
    """Send `prompt` to `url` (http[s]://host:port, with or without /v1) and wait for the answer.
    Greedy unless `temperature` says otherwise (OpenAI's own default would be 1); `raw`:
    /v1/completions with the prompt as it is, else /v1/chat/completions with one user message."""
    import openai

    base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=timeout_s)
    kwargs: dict[str, Any] = {"model": model, "temperature": 0.0 if temperature is None else temperature}
    for key, value in (("max_tokens", max_tokens), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            kwargs[key] = value
    if stop:
        kwargs["stop"] = list(stop)
    if raw:
        create, kwargs["prompt"] = client.completions.create, prompt
    else:
        create, kwargs["messages"] = client.chat.completions.create, [{"role": "user", "content": prompt}]

    def text_of(choice: Any) -> str:  # a completion's choice has text, a chat's message or delta
        if raw:
            return choice.text or ""
        return (choice.message.content if hasattr(choice, "message") and choice.message else
                getattr(getattr(choice, "delta", None), "content", None)) or ""

    t0 = time.perf_counter()
    try:
        if not stream:
            r = create(**kwargs)
            text = text_of(r.choices[0])
            out = ClientResult(text, r.choices[0].finish_reason or "", _stats(r.model_extra, r.usage), chunks=1)
            out.ttft_s = time.perf_counter() - t0
            if on_text is not None and text:
                on_text(text)
        else:
            out = ClientResult("", "", streamed=True)
            parts: list[str] = []
            for chunk in create(**kwargs, stream=True, stream_options={"include_usage": True}):
                piece = text_of(chunk.choices[0]) if chunk.choices else ""
                if piece:
                    out.ttft_s = out.ttft_s or time.perf_counter() - t0
                    parts.append(piece)
                    out.chunks += 1
                    if on_text is not None:
                        on_text(piece)
                if chunk.choices and chunk.choices[0].finish_reason:
                    out.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None or (chunk.model_extra or {}).get("dflash"):
                    out.stats.update(_stats(chunk.model_extra, chunk.usage))
            out.text = "".join(parts)
    except openai.APIConnectionError as e:
        raise DFlashError(f"cannot reach an OpenAI-compatible server at {url}: {e}; is `dflash-trt serve` (its "
                          f"OpenAI front, --openai-port) or vllm serve running there?") from None
    except openai.APIStatusError as e:
        raise DFlashError(f"{url} model {model!r}: HTTP {e.status_code}: {e.message}") from None
    finally:
        client.close()
    out.latency_s = time.perf_counter() - t0
    return out
