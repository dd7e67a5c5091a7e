"""The HTTP front of the mesh: OpenAI-compatible and SGLang-style APIs over NATS engines.

One request, hop by hop:
1. `handlers` (aiohttp; `app.init(config)` builds the app, `middlewares` check the key and
   read the body) picks the served model (`models`: the tokenizer and chat template of the
   model card its engines published); `protocol` validates the body into a
   `GenerationSpec` (typed reads in `fields`; the prompt tokenized by that `tokenizer`, chat
   messages rendered by its `chat` template); every error is an OpenAI-style 4xx from
   `errors`. `probes` (/health, /ready, /v1/models, /metrics) and `admin` (/flush_cache,
   /stats) are the other endpoints.
2. `engines` (the live-engine table from heartbeats) gives the bucket's live engines;
   `protocol.check_limits` checks the ids and lengths against them.
3. `routing` hashes the prompt's pages, asks Redis once (`PREFIX_LOOKUP_LUA`), and picks
   the engine with the best cached prefix minus load (for P/D: a decode and a prefill
   engine, each by its own cache).
4. `generation` sends the request through `stream` (a `reply_hub` subject, chunks in `seq`
   order, timeouts, liveness; a P/D prefill engine is watched by a `PrefillWatch`), applies
   stop strings (`detokenize`), retries once elsewhere when the engine failed before its
   first chunk. With a live prefill and decode engine in the bucket it serves by P/D
   instead (`disagg`: admit on decode, prefill sends KV, decode streams; restore and
   transfer failures retried once). What it produced is an `outcome` (and its `Timings`,
   the Server-Timing header).
   A request for `n` choices runs them side by side (`choices`): the others once choice 0
   has cached the prompt, on its engine.
5. `delivery` sends whole bodies or SSE chunks, shaped by `responses` (logprobs, usage);
   `accounting` counts (`metrics`) and records (`record`).

Nothing here imports torch, triton, gpu_worker or services (DESIGN.md section 1).
"""
