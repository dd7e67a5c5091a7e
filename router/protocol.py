"""Request bodies -> one validated `GenerationSpec`, or an `ApiError` (status rule: errors.py).

Validation happens in two steps, both before anything is sent to an engine:
1. `parse_completion` / `parse_chat` / `parse_generate`: types, ranges, enum values, the
   prompt (tokenized here). JSON `null` counts as "not given" for optional fields.
2. `check_limits`: token ids against the engine's vocabulary, prompt + max_tokens against
   its context length. A given `max_tokens` is never cut. Without one, completions and chat
   generate up to what the context leaves after the prompt, as OpenAI and vLLM do (capped
   by the router's `--default-max-tokens` when set), and `/generate` up to SGLang's default
   `max_new_tokens` of 128, cut to what the context leaves. `max_tokens` (and
   `max_completion_tokens`) must be >= 1; `/generate` takes SGLang's `max_new_tokens: 0`.
   An error names only values the client sent.

Prompt ids become a `TokenIds` (array('I')) here, once, and stay compact to the bus; their
checks are vectorised (`router.fields.parse_token_ids`).

OpenAI endpoints ignore unknown top-level fields (clients send many) but reject, with a 400
naming the parameter, a set value of a feature the router does not implement (tools and
function calling, `response_format` other than text, `echo`, `suffix`, `best_of`, audio,
...: `UNSUPPORTED`). `/generate` rejects unknown fields at the top level and in
`sampling_params`.

Sampling parameters, each as OpenAI or SGLang name it: `temperature`, `top_p`, `top_k`
(0 or -1: off), `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`,
`logit_bias` (token id -> bias in [-100, 100]), `seed`, `stop`, `stop_token_ids` (up to
`MAX_STOP_TOKEN_IDS`), `ignore_eos`; `n` choices (up to `MAX_N`); `logprobs` (completions: the number of top
logprobs; chat: `logprobs` true and `top_logprobs`; `/generate`: `return_logprob` and
`top_logprobs_num`, up to `MAX_LOGPROBS`). Streams send usage only when asked
(`stream_options.include_usage`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from bus_schemas import Sampling
from bus_schemas.token_ids import TokenIds, as_token_ids
from router.chat import ChatTemplateError
from router.errors import ApiError, bad_request
from router.fields import Fields, nonempty, parse_messages, parse_token_ids
from router.models import ServedModel
from router.prompt_workers import PromptText, encode_prompt

DEFAULT_MAX_NEW_TOKENS = 128  # /generate without sampling_params.max_new_tokens (SGLang's)
MAX_SEED = 2**63  # seeds are in [0, 2**63): they seed a 64-bit generator
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs (the engine's too)
MAX_STOP_TOKEN_IDS = 1024  # the engine checks every output token against them
# a text prompt longer than this many characters per token of the model's context cannot
# fit it with any tokenizer we know (the byte tokenizer: 1; BPE vocabularies: about 4)
CHARS_PER_TOKEN = 32

GENERATE_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "cache_salt",
        "cache_namespace",
        "return_logprob",
        "top_logprobs_num",
    }
)
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    }
)
# OpenAI fields whose set values the router does not implement; a value equal to the
# listed "off" value is accepted (clients send defaults)
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "echo": (False,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
}


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """One validated request. Token ids are checked against an engine by `check_limits`."""

    endpoint: str  # "completions" | "chat" | "generate"
    input_ids: TokenIds
    max_tokens: int | None  # None: not given (check_limits decides: what the context leaves)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, matched by the router on decoded text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # None: none; k: each token's logprob and the top k's
    n: int = 1  # choices
    stream: bool = False
    include_usage: bool = False  # a stream ends with a usage chunk (stream_options)
    cache_salt: str = ""
    # a shared cache namespace the request names (router/auth.py: tenants); None: its own
    cache_namespace: str | None = None
    model: str | None = None  # the model the client asked for, if any
    # max(input_ids) when parsing had it cheaply (max over the decoded JSON list costs half
    # of max over the array); None: check_limits computes it
    max_input_id: int | None = None

    def sampling(self, max_new_tokens: int, choice: int = 0) -> Sampling:
        """The engine's sampling for choice `choice` of `n`: a seeded request's choices draw
        from seeds `seed`, `seed + 1`, ... (else they would all draw alike)."""
        seed = None if self.seed is None else (self.seed + choice) % MAX_SEED
        return Sampling(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={str(t): b for t, b in self.logit_bias},
            logprobs=self.logprobs,
        )


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 413 over the size limit, 400 when not a JSON object."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"request body too large: {e.text}", code="body_too_large") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body


def prompt_text(
    endpoint: str, body: Mapping[str, Any], max_chars: int, refuse_special: bool = False
) -> PromptText | None:
    """The request's prompt when it is text, checked against `max_chars` (its characters; a
    chat request's message contents together) before anything tokenizes it: 400
    `prompt_too_long` beyond. None when the prompt is token ids, or missing or malformed
    (the endpoint's parser says how)."""
    if endpoint == "chat":
        value = body.get("messages")
        if not isinstance(value, list) or not value:
            return None
        messages = tuple(parse_messages(value))
        _check_chars("messages", sum(len(m.content) for m in messages), max_chars)
        return PromptText("messages", messages=messages, refuse_special=refuse_special)
    param = "text" if endpoint == "generate" else "prompt"
    value = body.get(param)
    if endpoint == "completions":
        value = _unbatched(value)
    if not isinstance(value, str):
        return None
    _check_chars(param, len(value), max_chars)
    return PromptText(param, text=value, refuse_special=refuse_special)


def _check_chars(param: str, num_chars: int, max_chars: int) -> None:
    if num_chars > max_chars:
        raise bad_request(
            f"'{param}' has {num_chars} characters; this server takes at most {max_chars} "
            f"(--max-prompt-chars, and {CHARS_PER_TOKEN} per token of the model's context)",
            param,
            "prompt_too_long",
        )


# ------------------------------------------------------------------ endpoints


def parse_completion(
    body: Mapping[str, Any],
    model: ServedModel,
    max_stop: int,
    encoded: TokenIds | None = None,
) -> GenerationSpec:
    """`encoded`: the ids of a text prompt, tokenized already (`router.prompt_workers`);
    None: tokenized here (tests)."""
    _reject_unsupported(body)
    ids, max_id = _prompt_ids(body.get("prompt"), model, encoded)
    logprobs = Fields(body).int_("logprobs", 0, MAX_LOGPROBS)
    return _openai_spec("completions", body, ids, max_stop, logprobs, max_id)


def parse_chat(
    body: Mapping[str, Any],
    model: ServedModel,
    max_stop: int,
    encoded: TokenIds | None = None,
) -> GenerationSpec:
    """`encoded`: the rendered and tokenized messages (`router.prompt_workers`); None: done
    here (tests)."""
    _reject_unsupported(body)
    f = Fields(body)
    want = f.bool_("logprobs", False)
    top = f.int_("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if encoded is None:
        messages = tuple(parse_messages(body.get("messages")))
        try:
            encoded = encode_prompt(model, PromptText("messages", messages=messages), None)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages", "chat_template_error") from None
        except ValueError as e:
            raise ApiError(500, str(e), code="chat_template_unusable") from None
    ids = nonempty(encoded, "messages")
    return _openai_spec("chat", body, ids, max_stop, (top or 0) if want else None)


def parse_generate(
    body: Mapping[str, Any],
    model: ServedModel,
    max_stop: int,
    encoded: TokenIds | None = None,
) -> GenerationSpec:
    """`encoded`: the ids of `text`, tokenized already; None: tokenized here (tests)."""
    tok = model.tokenizer
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}", unknown[0], "unknown_field")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", "text", "missing_prompt")
    if text is not None:
        if not isinstance(text, str):
            raise bad_request("'text' must be a string", "text", "invalid_type")
        if encoded is None:
            encoded = as_token_ids(tok.encode(text))
        input_ids, max_id = nonempty(encoded, "text"), None
    else:
        input_ids, max_id = parse_token_ids(ids, "input_ids")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params", "invalid_type")
    unknown = sorted(set(sp) - SAMPLING_FIELDS)
    if unknown:
        param = f"sampling_params.{unknown[0]}"
        raise bad_request(f"unknown sampling parameter(s) {unknown}", param, "unknown_field")
    top = Fields(body)
    want = top.bool_("return_logprob", False)
    num = top.int_("top_logprobs_num", 0, MAX_LOGPROBS)
    return GenerationSpec(
        endpoint="generate",
        input_ids=input_ids,
        max_tokens=Fields(sp, "sampling_params.").int_("max_new_tokens", 0, None),
        **_sampling(sp, "sampling_params.", max_stop),
        logprobs=(num or 0) if want else None,
        stream=top.bool_("stream", False),
        cache_salt=top.salt("cache_salt"),
        cache_namespace=top.salt("cache_namespace") or None,
        max_input_id=max_id,
    )


def check_limits(
    spec: GenerationSpec,
    vocab_size: int,
    context_len: int,
    default_len: int | None = None,
    default_max_tokens: int | None = None,
) -> int:
    """The max_new_tokens to send; raises 400 for ids outside the vocabulary or a request
    that does not fit the context.

    A request without max_tokens may reach `default_len` tokens in all (prompt included;
    the serving bucket's `max_len`, when it is shorter than `context_len` and the prompt
    fits it), at most `default_max_tokens` new ones (the router's cap; None: none) on the
    OpenAI endpoints and `DEFAULT_MAX_NEW_TOKENS` on `/generate`."""
    native = spec.endpoint == "generate"
    stop_param = "sampling_params.stop_token_ids" if native else "stop_token_ids"
    bias_param = "sampling_params.logit_bias" if native else "logit_bias"
    checks = (
        ("prompt", spec.input_ids, spec.max_input_id),
        (stop_param, spec.stop_token_ids, None),
        (bias_param, [t for t, _ in spec.logit_bias], None),
    )
    for param, ids, max_id in checks:
        if not ids:
            continue
        if (max(ids) if max_id is None else max_id) < vocab_size:
            continue  # ids are >= 0 already (array('I') or checked by _token_ids)
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise bad_request(
            f"{param} token {i} is {t}: token ids must be integers in [0, {vocab_size})",
            param,
            "invalid_token_id",
        )
    prompt_len = len(spec.input_ids)
    if spec.max_tokens is not None:
        if prompt_len + spec.max_tokens > context_len:
            name = "sampling_params.max_new_tokens" if native else "max_tokens"
            raise bad_request(
                f"the prompt ({prompt_len} tokens) plus {name.rsplit('.', 1)[-1]} "
                f"({spec.max_tokens}) exceeds the context length {context_len}",
                name,
                "context_length_exceeded",
            )
        return spec.max_tokens
    if prompt_len >= context_len:  # the client sent no max_tokens: name none
        raise bad_request(
            f"the prompt ({prompt_len} tokens) leaves no room for output in the context "
            f"length {context_len}",
            "messages" if spec.endpoint == "chat" else "prompt",
            "context_length_exceeded",
        )
    limit = context_len
    if default_len is not None and prompt_len < default_len:
        limit = min(limit, default_len)
    cap = DEFAULT_MAX_NEW_TOKENS if native else default_max_tokens
    return min(limit - prompt_len, cap) if cap is not None else limit - prompt_len


# ------------------------------------------------------------------ pieces


def _openai_spec(
    endpoint: str,
    body: Mapping[str, Any],
    ids: TokenIds,
    max_stop: int,
    logprobs: int | None,
    max_input_id: int | None = None,
) -> GenerationSpec:
    f = Fields(body)
    max_tokens = f.int_("max_tokens", 1, None)
    if endpoint == "chat":
        alias = f.int_("max_completion_tokens", 1, None)
        max_tokens = max_tokens if alias is None else alias
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    stream = f.bool_("stream", False)
    # OpenAI's `user` isolates the cache when no explicit cache_salt is given.
    cache_salt = f.salt("cache_salt") or f.salt("user")
    return GenerationSpec(
        endpoint=endpoint,
        input_ids=ids,
        max_tokens=max_tokens,
        **_sampling(body, "", max_stop),
        logprobs=logprobs,
        n=f.int_("n", 1, MAX_N) or 1,
        stream=stream,
        include_usage=_include_usage(body, stream),
        cache_salt=cache_salt,
        cache_namespace=f.salt("cache_namespace") or None,
        model=model or None,
        max_input_id=max_input_id,
    )


def _sampling(body: Mapping[str, Any], prefix: str, max_stop: int) -> dict[str, Any]:
    """The sampling fields every endpoint shares, as GenerationSpec keywords."""
    f = Fields(body, prefix)
    stop_token_ids = body.get("stop_token_ids")
    if isinstance(stop_token_ids, list) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        param = prefix + "stop_token_ids"
        raise bad_request(f"'{param}' allows at most {MAX_STOP_TOKEN_IDS} token ids", param)
    top_k = f.int_("top_k", -1, None)
    return {
        "temperature": f.temperature(),
        "top_p": f.top_p(),
        "top_k": 0 if top_k is None or top_k < 0 else top_k,  # -1 (SGLang's off) -> 0
        "min_p": f.ranged("min_p", 0.0, 0.0, 1.0),
        "repetition_penalty": f.positive("repetition_penalty", 1.0),
        "presence_penalty": f.ranged("presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": f.ranged("frequency_penalty", 0.0, -2.0, 2.0),
        "logit_bias": f.logit_bias(),
        "seed": f.int_("seed", 0, MAX_SEED - 1),
        "stop": f.stop(max_stop),
        "stop_token_ids": ()
        if stop_token_ids is None
        else tuple(parse_token_ids(stop_token_ids, prefix + "stop_token_ids", empty_ok=True)[0]),
        "ignore_eos": f.bool_("ignore_eos", False),
    }


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' needs 'stream': true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    return Fields(options, "stream_options.").bool_("include_usage", False)


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in off:
            raise bad_request(
                f"'{name}' is not supported by this server", name, "unsupported_parameter"
            )
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad_request(
            'only \'response_format\': {"type": "text"} is supported',
            "response_format",
            "unsupported_parameter",
        )
    if Fields(body).int_("best_of", 1, None) not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of", "unsupported_value")


def _prompt_ids(
    prompt: Any, model: ServedModel, encoded: TokenIds | None
) -> tuple[TokenIds, int | None]:
    """The prompt's ids, and their max when it came cheaply (see GenerationSpec)."""
    prompt = _unbatched(prompt)
    if isinstance(prompt, str):
        if encoded is None:
            encoded = as_token_ids(model.tokenizer.encode(prompt))
        return nonempty(encoded, "prompt"), None
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, str | list) for p in prompt):
            raise bad_request("only one prompt per request", "prompt", "unsupported_value")
        return parse_token_ids(prompt, "prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required")
    raise bad_request(
        "'prompt' must be a string or a list of token ids", "prompt", code="invalid_type"
    )


def _unbatched(prompt: Any) -> Any:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]  # a batch of one
    return prompt
