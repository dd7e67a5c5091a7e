"""A request inside the engine, and what the engine hands back for it."""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from bus_schemas.token_ids import TokenIds, as_token_ids
from gpu_worker.cache.hicache import LoadTicket
from gpu_worker.cache.radix import TreeNode
from gpu_worker.cache.storage_tier import Prefetch
from gpu_worker.memory.allocator import PageId
from gpu_worker.model.sampling import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, nothing reserved
    LOADING = "loading"  # admitted; its host hit is being loaded back
    PREFILL = "prefill"  # computing its prompt, chunk by chunk
    RECEIVING = "receiving"  # P/D decode: waiting for the prompt's KV from a prefill engine
    DECODE = "decode"  # generating
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """Prompt tokens served from each tier instead of being computed (`storage`: read from
    external storage for this request, then loaded through the host tier)."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request failed, as its caller is told."""

    message: str  # for the client, e.g. "restore could not deliver the promised prefix"
    # HTTP-like status: 400 the request's fault, 409 retry without reuse, 500 the engine's
    # fault, 503 retry on another engine
    code: int


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    rid: int
    prompt_len: int
    output_ids: list[int]
    cached: CachedTokens
    finish_reason: str  # "stop" (a stop/eos token), "length" (max_new_tokens) or "abort"
    # speculative decoding: per verify round (proposed, accepted); empty without a draft
    spec_rounds: tuple[tuple[int, int], ...] = ()

    @property
    def spec_accepted(self) -> int:
        return sum(a for _, a in self.spec_rounds)

    @property
    def spec_proposed(self) -> int:
        return sum(p for p, _ in self.spec_rounds)


@dataclass(slots=True)
class RemoteKV:
    """P/D decode side: the prompt's KV past `prefix_len` arrives from a prefill engine."""

    reuse: bool = True  # match the prompt against this engine's cache
    prefix_len: int = -1  # decode_prefix_len, known once admitted (page-aligned)
    received_end: int = -1  # KV of tokens [prefix_len, received_end) is written
    first_token: int | None = None  # sampled by prefill, arrives with the last chunk
    received_bytes: int = 0


@dataclass(frozen=True, slots=True)
class KVExport:
    """P/D prefill side: KV of tokens [token_start, token_end) packed for the wire.

    `stagings[i]` is world rank `ranks[i]`'s shard in the unified object order with one KV
    head per group, (its pages, its num_kv_heads, its num_layers, num_kv, page_size, 1,
    head_dim); rank 0 holds them all. `ranks` is `ParallelConfig.kv_ranks`: every rank, or
    for MLA (num_kv 1, one head, the latent row, the same on every TP rank of a stage) only
    TP rank 0 of each stage, so a replicated latent crosses the wire once; replicated CP
    sends CP rank 0's only. They are ranks of `ParallelConfig.kv_layout` (of `world_size`
    ranks), the layout a decode engine cuts from. Each shard holds every page, except under
    sharded CP (`cp_size` > 1): page `i` is then on CP rank `(rotation + i) % cp_size` only,
    and `stagings[i]` holds the pages of CP rank `cp_ranks[i]`, in order (`shard_rows`).

    With speculative decoding, `draft_stagings[i]` is the same rank's shard of the draft
    model's KV of the same pages, in its own shape: the decode engine needs the draft's
    state of the prompt too, and writes it into its draft pool at the same page ids. On the
    wire each page of a shard carries the target's rows, then the draft's (`shard_bytes`):
    the draft's layers follow the target's within the page, so a chunk of whole pages holds
    both and frames need no other marking; `draft` names the draft (`Engine.draft_id`), and
    a decode engine refuses a chunk whose draft is not its own.
    """

    stagings: tuple[torch.Tensor, ...]
    token_start: int
    token_end: int
    first_token: int
    ranks: tuple[int, ...] = (0,)
    world_size: int = 1  # of the exporting engine's kv_layout (its world, but at replicated CP)
    cp_size: int = 1  # sharded CP: the CP ranks the pages are spread over
    rotation: int = 0  # sharded CP: the CP rank that owns the first page
    cp_ranks: tuple[int, ...] = ()  # sharded CP: each staging's CP rank
    draft_stagings: tuple[torch.Tensor, ...] = ()  # speculative decoding: the draft's shards
    draft: str = ""  # the draft's identity (`Engine.draft_id`); "" without one

    @property
    def num_pages(self) -> int:
        return -(-(self.token_end - self.token_start) // self.page_size)

    @property
    def page_size(self) -> int:
        return int(self.staging.shape[4])

    @property
    def staging(self) -> torch.Tensor:
        """Rank 0's shard (the whole KV in a world of one)."""
        return self.stagings[0]

    def shard_rows(self, i: int, lo: int, hi: int) -> slice:
        """The rows of `stagings[i]` that hold pages [lo, hi) of the export: all of them,
        or under sharded CP those of its CP rank (possibly none)."""
        if self.cp_size == 1:
            return slice(lo, hi)
        n, first = self.cp_size, (self.cp_ranks[i] - self.rotation) % self.cp_size
        return slice(-(-(lo - first) // n), -(-(hi - first) // n))  # rows j: lo <= first+jn < hi

    def page_bytes(self, i: int) -> int:
        """Bytes of one page of shard `i` on the wire (the target's and the draft's)."""
        shards = [self.stagings[i], *self.draft_stagings[i : i + 1]]
        return sum(math.prod(s.shape[1:]) * s.element_size() for s in shards)

    def shard_bytes(self, i: int, rows: slice) -> bytes:
        """Rows `rows` of shard `i` as sent: page by page, the target's rows then the
        draft's (just the target's without a draft)."""
        target = self.stagings[i][rows]
        if not self.draft_stagings:
            return target.contiguous().numpy().tobytes()
        draft = self.draft_stagings[i][rows]
        n = target.shape[0]
        both = torch.cat([target.reshape(n, -1), draft.reshape(n, -1)], dim=1)
        return both.contiguous().numpy().tobytes()


@dataclass(slots=True)
class ReqLens:
    """A request's token lengths: the one place that says what each means.

    Every length counts tokens of the sequence prompt + output from position 0:
    - `cached_len`: the front whose pages belong to the radix tree, pinned by `Req.last_node`
      (page-aligned; it grows when the request inserts its KV into the tree);
    - `computed_len`: prompt tokens whose KV is in the pool: the cached prefix, what was
      loaded from the host tier (for P/D decode, `RemoteKV.prefix_len`, the part it did not
      receive), then the chunks computed; `prompt_len` once prefill is done;
    - `kv_len`: tokens whose KV is in the pool: `computed_len` until the first output token,
      then every token but the last output (a step writes the KV of the tokens it feeds and
      appends the tokens it samples after them);
    - `seq_len`: prompt + output;
    - `max_kv_len`: slots the request may ever write: the prompt and all but the last of
      `max_new_tokens` outputs (admission reserves pages for them up front).

    Invariant, checked by `check`, from admission until the request finishes:
    cached_len <= computed_len <= kv_len <= seq_len, computed_len <= prompt_len, and
    kv_len <= max_kv_len. A step appends n >= 0 output tokens (`Req.append_outputs`; a
    decode step appends one, a speculative one up to its proposals + 1, a prefill chunk
    before the last none). A speculative verify also writes KV past `kv_len` (of proposals
    it may reject), but never past `max_kv_len`: a round proposes at most the outputs left
    but one (`scheduler/spec_step.py`), so no extra slot is reserved.
    """

    prompt_len: int
    max_new_tokens: int
    cached_len: int = 0
    computed_len: int = 0
    output_len: int = 0  # len(Req.output_ids), kept by `Req.append_outputs`

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def kv_len(self) -> int:
        return self.seq_len - 1 if self.output_len else self.computed_len

    @property
    def max_kv_len(self) -> int:
        return self.prompt_len + max(self.max_new_tokens - 1, 0)

    def check(self) -> None:
        """Raise AssertionError when the invariant does not hold."""
        assert 0 <= self.cached_len <= self.computed_len <= self.kv_len <= self.seq_len, self
        assert self.computed_len <= self.prompt_len and self.kv_len <= self.max_kv_len, self


@dataclass(eq=False, slots=True)
class Req:
    rid: int
    prompt_ids: TokenIds  # array('I'): reaches the radix tree as is (a list is converted once)
    sampling: SamplingParams
    cache_salt: str = ""  # requests share cached KV only with the same salt
    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)  # appended by `append_outputs` only
    page_ids: list[PageId] = field(default_factory=list)  # position x -> page_ids[x // page_size]
    lens: ReqLens = field(init=False)  # what its lengths mean, and their invariant
    last_node: TreeNode | None = None  # the tree node this request holds locked
    load: LoadTicket | None = None
    prefetch: Prefetch | None = None  # from external storage, while it waits (never pickled)
    cached: CachedTokens = CachedTokens()
    finish_reason: str | None = None
    aborted: bool = False  # finish at the next safe point (after any load completes)
    error: RequestError | None = None  # when it failed
    remote: RemoteKV | None = None  # P/D decode: KV comes from a prefill engine
    export_from: int | None = None  # P/D prefill: pack KV from this token on at the end
    export: KVExport | None = None
    # per output token when `sampling.logprobs` is set: (its logprob, the top (id, logprob));
    # None for a P/D decode request's first token (sampled by the prefill engine)
    logprobs: list[tuple[float | None, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    # test/debug hook: set to [] to collect the logits (vocab,) each sampled token came from,
    # a copy per step, before sampling (the cache oracle compares them to a cold run)
    logits_trace: list[torch.Tensor] | None = None
    # speculative decoding: tokens of prompt + output whose draft KV is written (None without
    # a draft; at most `lens.kv_len`, one less after a round that accepted every proposal
    # until the next round feeds that one), and per verify round (proposed, accepted)
    draft_len: int | None = None
    spec_rounds: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = as_token_ids(self.prompt_ids)
        self.lens = ReqLens(len(self.prompt_ids), self.sampling.max_new_tokens)

    @property
    def spec_accepted(self) -> int:
        """Draft proposals the target accepted, over every verify round."""
        return sum(a for _, a in self.spec_rounds)

    @property
    def spec_proposed(self) -> int:
        return sum(p for p, _ in self.spec_rounds)

    @property
    def insert_len(self) -> int:
        """Tokens whose KV this request may insert into the tree: `lens.kv_len`, but with a
        draft only those whose draft KV is written too (a hit must cover both)."""
        kv = self.lens.kv_len
        return kv if self.draft_len is None else min(kv, self.draft_len)

    def token_ids(self, n: int) -> TokenIds:
        """The first `n` tokens of prompt + output, compact (what the tree inserts)."""
        if n <= len(self.prompt_ids):
            return self.prompt_ids[:n]
        return self.prompt_ids + as_token_ids(self.output_ids[: n - len(self.prompt_ids)])

    @property
    def prompt_len(self) -> int:
        return self.lens.prompt_len

    def append_outputs(self, tokens: Sequence[int], eos_token_ids: Collection[int]) -> int:
        """Append the n >= 0 tokens a step produced, in order, up to and including the first
        that finishes the request (a stop token, an EOS unless ignored, or the
        `max_new_tokens`-th output), and set `finish_reason` if one did. Returns how many
        were appended (the rest are dropped)."""
        sp = self.sampling
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            self.lens.output_len += 1
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= sp.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                return i + 1
        return len(tokens)

    def output(self) -> GenerateOutput:
        assert self.finish_reason is not None
        return GenerateOutput(
            self.rid,
            self.prompt_len,
            list(self.output_ids),
            self.cached,
            self.finish_reason,
            tuple(self.spec_rounds),
        )
