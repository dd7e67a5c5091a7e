"""Response bodies: OpenAI completions and chat (whole and SSE chunks), SGLang `/generate`.

Extensions to the OpenAI shapes: every choice carries `token_ids` (the generated ids; in a
stream chunk, the ids that arrived with it), and `usage.prompt_tokens_details` carries
`cached_tokens_by_tier: {device, host, storage}`; a P/D request's cached tokens are the decode
engine's own reuse (`decode_prefix_len`: prompt KV that neither moved nor was computed for
it), and its `usage.disaggregation` (`/generate`: `meta_info.disaggregation`) says what each
side reused (the prefill engine's skipped compute included) and what moved. With `n` choices,
usage counts the prompt once (choice 0's, whose prefill the others reuse) and the
completion tokens of all.

Streams send usage only when the request asked for it (`stream_options.include_usage`): then
every chunk has `"usage": null`, and a last chunk with no choices carries it, as OpenAI's
API does. `/generate` streams cumulative `text` and `output_ids` (as SGLang does), with
`meta_info.finish_reason` null until the last event.

Logprobs: completions give OpenAI's legacy shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), chat the `content` list (`token`, `logprob`, `bytes`,
`top_logprobs`), `/generate` SGLang's `output_token_logprobs` and `output_top_logprobs`
(`[logprob, token_id, null]`). A token's text is its bytes decoded (a token holding part of
a UTF-8 character shows U+FFFD; `bytes` has the truth). A P/D request's first token was
sampled by prefill, which does not report its logprob: it is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from router.outcome import Outcome, TokenLogprob
from router.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(outs: Sequence[Outcome], hide_cache: bool = False) -> dict[str, Any]:
    """OpenAI's usage; `hide_cache` (the router's --hide-cache-stats) leaves out every cache
    figure (`prompt_tokens_details`, `disaggregation`): they tell whether a prompt was seen."""
    first = outs[0]
    completion = sum(len(out.output_ids) for out in outs)
    body: dict[str, Any] = {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
    }
    if hide_cache:
        return body
    body |= {
        "prompt_tokens_details": {
            "cached_tokens": first.cached_tokens,
            "cached_tokens_by_tier": {
                "device": first.cached_device,
                "host": first.cached_host,
                "storage": first.cached_storage,
            },
        },
    }
    if first.disaggregation is not None:
        body["disaggregation"] = first.disaggregation.as_dict()
    return body


class OpenAIShape:
    """Bodies for one completions or chat request (`chat` selects the object names)."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        created: int,
        tokenizer: Tokenizer,
        include_usage: bool = False,
        hide_cache: bool = False,
    ) -> None:
        self.chat = chat
        self.hide_cache = hide_cache
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = created
        self.tok = tokenizer
        self.include_usage = include_usage
        self._text_offset: dict[int, int] = {}  # per choice: completion characters so far

    def whole(self, outs: Sequence[Outcome], logprobs: bool) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice["token_ids"] = out.output_ids
            choice["logprobs"] = self._logprobs(index, out.logprobs) if logprobs else None
            choice["finish_reason"] = out.finish_reason
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices) | {"usage": usage(outs, self.hide_cache)}

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`; `logprobs`, when asked, of its tokens."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["token_ids"] = token_ids
        choice["logprobs"] = None if logprobs is None else self._logprobs(index, logprobs)
        choice["finish_reason"] = finish_reason
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, outs: Sequence[Outcome]) -> dict[str, Any]:
        """A stream's last chunk when usage was asked for: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(outs, self.hide_cache)}

    def _logprobs(self, index: int, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = [
                _chat_entry(self.tok, lp.token_id, lp.logprob)
                | {"top_logprobs": [_chat_entry(self.tok, t, v) for t, v in lp.top]}
                for lp in lps
            ]
            return {"content": content, "refusal": None}
        tokens = [self._text(lp.token_id) for lp in lps]
        offsets = []
        offset = self._text_offset.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        return self.tok.token_bytes(token_id).decode("utf-8", errors="replace")

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _chat_entry(tok: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    data = tok.token_bytes(token_id)
    return {
        "token": data.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(data),
    }


def generate_body(
    out: Outcome, text: str | None = None, logprobs: bool = False, hide_cache: bool = False
) -> dict[str, Any]:
    """The `/generate` body; a stream passes the `text` released so far. `hide_cache`: no
    cached-token figures, engine or disaggregation (as `usage`)."""
    meta: dict[str, Any] = {
        "id": out.request_id,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "finish_reason": out.finish_reason,
    }
    if not hide_cache:
        meta |= {
            "cached_tokens": out.cached_tokens,
            "cached_tokens_device": out.cached_device,
            "cached_tokens_host": out.cached_host,
            "cached_tokens_storage": out.cached_storage,
            "engine_id": out.engine_id,
        }
    if out.spec_verify_ct:  # speculative decoding (SGLang's meta info names)
        meta |= {
            "spec_verify_ct": out.spec_verify_ct,
            "spec_draft_token_num": out.spec_draft_tokens,
            "spec_accept_token_num": out.spec_accepted_tokens,
            "spec_accept_rate": out.spec_accepted_tokens / max(1, out.spec_draft_tokens),
            # tokens per verify round (accepted + 1), as SGLang's spec_accept_length
            "spec_accept_length": (out.spec_accepted_tokens + out.spec_verify_ct)
            / out.spec_verify_ct,
        }
    if out.disaggregation is not None and not hide_cache:
        meta["disaggregation"] = out.disaggregation.as_dict()
    if logprobs:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in out.logprobs]
        meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in out.logprobs]
    return {
        "text": out.text if text is None else text,
        "output_ids": out.output_ids,
        "meta_info": meta,
    }
