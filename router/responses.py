"""Response bodies: OpenAI completions and chat (whole and SSE chunks), SGLang `/generate`.

Extensions to the OpenAI shapes: every choice carries `token_ids` (the generated ids; in a
stream chunk, the ids that arrived with it), and `usage.prompt_tokens_details` carries
`cached_tokens_by_tier: {device, host}`; a P/D request's cached tokens are the prefill
engine's (the prompt compute it skipped), and its `usage.disaggregation` (`/generate`:
`meta_info.disaggregation`) says what each side reused and what moved. In a stream the
chunk with `finish_reason` also carries `usage`. `/generate` streams cumulative `text` and
`output_ids` (as SGLang does), with `meta_info.finish_reason` null until the last event.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.generation import Outcome

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(out: Outcome) -> dict[str, Any]:
    completion = len(out.output_ids)
    body: dict[str, Any] = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": out.prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "cached_tokens_by_tier": {"device": out.cached_device, "host": out.cached_host},
        },
    }
    if out.disaggregation is not None:
        body["disaggregation"] = out.disaggregation.as_dict()
    return body


class OpenAIShape:
    """Bodies for one completions or chat request (`chat` selects the object names)."""

    def __init__(self, chat: bool, request_id: str, model: str, created: int) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = created

    def whole(self, out: Outcome) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice |= {"token_ids": out.output_ids, "logprobs": None}
        choice["finish_reason"] = out.finish_reason
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, [choice]) | {"usage": usage(out)}

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        out: Outcome | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk; pass `out` with the last one to include usage."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice |= {"token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [choice])
        if out is not None:
            body["usage"] = usage(out)
        return body

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def generate_body(out: Outcome, text: str | None = None) -> dict[str, Any]:
    """The `/generate` body; a stream passes the `text` released so far."""
    meta: dict[str, Any] = {
        "id": out.request_id,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "cached_tokens_device": out.cached_device,
        "cached_tokens_host": out.cached_host,
        "finish_reason": out.finish_reason,
        "engine_id": out.engine_id,
    }
    if out.disaggregation is not None:
        meta["disaggregation"] = out.disaggregation.as_dict()
    return {
        "text": out.text if text is None else text,
        "output_ids": out.output_ids,
        "meta_info": meta,
    }
