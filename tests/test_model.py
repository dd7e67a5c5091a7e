"""The decoder against a no-cache reference: chunked prefill, decode, ragged batches, slots."""

from __future__ import annotations

import copy
import math
from typing import cast

import pytest
import torch

from gpu_worker.model import (
    PRESETS,
    ByteTokenizer,
    ForwardBatch,
    LlamaModel,
    attention_plan,
    build_model,
    load_tokenizer,
)
from gpu_worker.model.layers import Linear
from gpu_worker.model.llama import DecoderLayer, create_model
from gpu_worker.model.weights import init_random_weights

DEVICE = torch.device("cpu")
DTYPE = torch.float64
ATOL = 1e-10


class DenseKVCache:
    """The simplest `KVCache`: one (num_layers, 2, num_slots, n_kv_heads, head_dim) tensor,
    read by gathers only (no in-place slices); it records the layers `before_attention`
    was called for."""

    contiguous_slices = False

    def __init__(self, model: LlamaModel, num_slots: int) -> None:
        shape = (model.num_layers, 2, num_slots, model.num_kv_heads, model.head_dim)
        self.kv = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
        self.hooked_layers: list[int] = []

    def before_attention(self, layer: int, batch: ForwardBatch) -> None:
        self.hooked_layers.append(layer)

    def after_layers(self, batch: ForwardBatch) -> None:
        self.hooked_layers.append(-1)

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a pool without contiguous slices is never sliced")

    def set_kv(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, slot_ids] = k
        self.kv[layer, 1, slot_ids] = v

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0, slot_ids], self.kv[layer, 1, slot_ids]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return build_model("tiny", DEVICE, DTYPE, seed=0)[1]


def prompt(n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def run_chunks(
    model: LlamaModel,
    cache: DenseKVCache,
    tokens: list[int],
    chunks: list[int],
    slots: torch.Tensor,
) -> list[torch.Tensor]:
    """Feed `tokens` as consecutive chunks of the given sizes; logits (vocab,) after each."""
    out, done = [], 0
    for size in chunks:
        seq_slots = slots[: done + size]
        batch = ForwardBatch.build([(tokens[done : done + size], done, seq_slots)], DEVICE)
        out.append(model(batch, cache)[0])
        done += size
    assert done == len(tokens)
    return out


def layers(model: LlamaModel) -> list[DecoderLayer]:
    return cast(list[DecoderLayer], list(model.layers))


@torch.no_grad()
def reference_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits (T, vocab) of the whole sequence with no cache: plain-math attention over a
    triangular mask, reusing only the model's weights and its RoPE tables."""
    cfg = model.config
    T = len(tokens)
    h = model.embed_tokens(torch.tensor(tokens))  # (T, hidden)
    cos, sin = model.rotary.cos[:T, None, :], model.rotary.sin[:T, None, :]  # (T, 1, D)

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # (T, T)
    for layer in layers(model):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = rope(attn.q_proj(x).view(T, cfg.num_heads, cfg.head_dim))  # (T, H, D)
        k = rope(attn.k_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim))  # (T, KV, D)
        v = attn.v_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim)  # (T, KV, D)
        k = k.repeat_interleave(cfg.group_size, dim=1)  # (T, H, D)
        v = v.repeat_interleave(cfg.group_size, dim=1)  # (T, H, D)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)  # (H, T, T)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(T, -1)  # (T, H * D)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.compute_logits(model.norm(h))


@torch.no_grad()
def test_chunked_prefill_and_decode_match_reference(model: LlamaModel) -> None:
    tokens = prompt(20)
    slots = torch.arange(len(tokens))
    ref = reference_logits(model, tokens)
    whole = run_chunks(model, DenseKVCache(model, 32), tokens, [20], slots)
    chunked = run_chunks(model, DenseKVCache(model, 32), tokens, [7, 5, 8], slots)
    decoded = run_chunks(model, DenseKVCache(model, 32), tokens, [12] + [1] * 8, slots)
    torch.testing.assert_close(whole[0], ref[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked[-1], ref[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked[0], ref[6], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked[1], ref[11], atol=ATOL, rtol=0)
    for step, logits in enumerate(decoded):
        torch.testing.assert_close(logits, ref[11 + step], atol=ATOL, rtol=0)


@torch.no_grad()
def test_ragged_batch_equals_each_request_alone(model: LlamaModel) -> None:
    # (tokens, prefix already cached): a fresh prefill, a chunk on a prefix, a decode step.
    requests = [(prompt(9, seed=2), 0), (prompt(11, seed=3), 6), (prompt(13, seed=4), 12)]
    slots = [torch.arange(0, 9), torch.arange(16, 27), torch.arange(32, 45)]
    cache = DenseKVCache(model, 48)
    for (tokens, prefix_len), seq_slots in zip(requests, slots, strict=True):
        if prefix_len:
            run_chunks(model, cache, tokens[:prefix_len], [prefix_len], seq_slots)
    alone = []
    for (tokens, prefix_len), seq_slots in zip(requests, slots, strict=True):
        own = DenseKVCache(model, 48)
        own.kv.copy_(cache.kv)
        new = tokens[prefix_len:]
        batch = ForwardBatch.build([(new, prefix_len, seq_slots)], DEVICE)
        alone.append(model(batch, own)[0])
    seqs = [(t[p:], p, s) for (t, p), s in zip(requests, slots, strict=True)]
    batched = model(ForwardBatch.build(seqs, DEVICE), cache)
    assert batched.shape == (3, PRESETS["tiny"].vocab_size)
    torch.testing.assert_close(batched, torch.stack(alone), atol=ATOL, rtol=0)
    for (tokens, _), row in zip(requests, batched, strict=True):
        torch.testing.assert_close(row, reference_logits(model, tokens)[-1], atol=ATOL, rtol=0)


@torch.no_grad()
def test_slots_need_not_be_contiguous(model: LlamaModel) -> None:
    tokens = prompt(15, seed=5)
    contiguous = run_chunks(model, DenseKVCache(model, 64), tokens, [10, 1, 4], torch.arange(15))
    scattered = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:15]
    permuted = run_chunks(model, DenseKVCache(model, 64), tokens, [10, 1, 4], scattered)
    for a, b in zip(contiguous, permuted, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@torch.no_grad()
def test_before_attention_runs_once_per_layer_and_pass(model: LlamaModel) -> None:
    """The per-layer hook (where a CP gather or a layer-wise load wait goes) precedes each
    layer of every forward pass, in layer order, and `after_layers` (-1 here, where a CP
    pool ends its reads of peers' rows) follows the pass's last layer."""
    cache = DenseKVCache(model, 32)
    run_chunks(model, cache, prompt(6), [4, 1, 1], torch.arange(6))
    assert cache.hooked_layers == [*range(model.num_layers), -1] * 3


class SlicingKVCache(DenseKVCache):
    """A pool that offers `kv_slice` (runs of consecutive slots read in place, as the device
    pool does) and counts how the decode attention read it."""

    contiguous_slices = True

    def __init__(self, model: LlamaModel, num_slots: int) -> None:
        super().__init__(model, num_slots)
        self.slices = self.gathers = 0

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.gathers += 1
        return super().get_kv(layer, slot_ids)

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.slices += 1
        return self.kv[layer, 0, start:end], self.kv[layer, 1, start:end]


@torch.no_grad()
def test_decode_reads_runs_of_slots_in_place_and_gathers_fragmented_rows(
    model: LlamaModel,
) -> None:
    """Decode rows whose slots form up to MAX_DECODE_RUNS runs attend over the pool in place
    (one run: one attention call; several: one joint softmax) when torch runs one thread or
    there is one row; a batch with a more fragmented row, or several rows on several
    threads, is gathered. Both give the no-cache reference's logits."""
    runs_of = {  # slots per request: 1 run, 3 runs (a cached prefix, then new pages), 7 runs
        "one": torch.arange(100, 117),
        "three": torch.cat([torch.arange(200, 208), torch.arange(40, 44), torch.arange(60, 65)]),
        "many": torch.arange(300, 356, 4)[:14].repeat_interleave(1) + torch.arange(14) % 2,
    }
    assert len(attention_plan._slot_runs(runs_of["three"])) == 3
    assert len(attention_plan._slot_runs(runs_of["many"])) > attention_plan.MAX_DECODE_RUNS
    tokens = {
        name: prompt(len(slots), seed=i + 7) for i, (name, slots) in enumerate(runs_of.items())
    }

    def decode(names: list[str]) -> tuple[torch.Tensor, SlicingKVCache]:
        cache = SlicingKVCache(model, 400)
        for name in names:  # prefill all but the last token, then decode it in one batch
            n = len(tokens[name]) - 1
            run_chunks(model, cache, tokens[name][:n], [n], runs_of[name])
        cache.slices = cache.gathers = 0
        seqs = [(tokens[name][-1:], len(tokens[name]) - 1, runs_of[name]) for name in names]
        return model(ForwardBatch.build(seqs, DEVICE), cache), cache

    threads = torch.get_num_threads()
    cases = [(["one", "three"], 1, True), (["one"], 2, True), (["three", "many"], 1, False)]
    cases.append((["one", "three"], 2, False))  # two threads: one padded call spreads rows
    for names, num_threads, in_place in cases:
        torch.set_num_threads(num_threads)
        try:
            logits, cache = decode(names)
        finally:
            torch.set_num_threads(threads)
        for name, row in zip(names, logits, strict=True):
            torch.testing.assert_close(
                row, reference_logits(model, tokens[name])[-1], atol=ATOL, rtol=0
            )
        if in_place:
            assert cache.slices > 0 and cache.gathers == 0, names
        else:
            assert cache.slices == 0 and cache.gathers > 0, names


@torch.no_grad()
def test_random_init_is_seeded() -> None:
    _, a = build_model("tiny", DEVICE, DTYPE, seed=7)
    _, b = build_model("tiny", DEVICE, DTYPE, seed=7)
    _, c = build_model("tiny", DEVICE, DTYPE, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    q_a, q_c = layers(a)[0].self_attn.q_proj.weight, layers(c)[0].self_attn.q_proj.weight
    assert not torch.equal(q_a, q_c)


@torch.no_grad()
def test_greedy_generation_is_not_degenerate() -> None:
    _, model = build_model("tiny", DEVICE, torch.float32, seed=0)
    cache = DenseKVCache(model, 64)
    cache.kv = cache.kv.float()
    tokens = ByteTokenizer().encode("The quick brown fox ")
    slots = torch.arange(64)
    batch = ForwardBatch.build([(tokens, 0, slots[: len(tokens)])], DEVICE)
    logits = model(batch, cache)
    generated = []
    for _ in range(32):
        next_id = int(logits[0].argmax())
        generated.append(next_id)
        tokens.append(next_id)
        n = len(tokens)
        batch = ForwardBatch.build([([next_id], n - 1, slots[:n])], DEVICE)
        logits = model(batch, cache)
    assert len(set(generated)) >= 6, generated


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, wörld — 你好 🙂"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, *tok.eos_token_ids]) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte character
    assert tok.vocab_size == PRESETS["tiny"].vocab_size


@torch.no_grad()
def test_greedy_continuations_are_varied_and_differ_between_prompts() -> None:
    """The float64 oracle compares outputs: they must carry information. Greedy continuations
    of several prompts use many distinct tokens, and no two prompts continue alike."""
    _, model = build_model("tiny", DEVICE, DTYPE, seed=0)
    continuations = []
    for seed in range(6):
        tokens = prompt(20, seed=seed + 10)
        cache, slots = DenseKVCache(model, 64), torch.arange(64)
        logits = run_chunks(model, cache, tokens, [20], slots)[-1]
        generated = []
        for _ in range(16):
            generated.append(int(logits.argmax()))
            tokens.append(generated[-1])
            logits = run_chunks(model, cache, tokens, [len(tokens) - 1, 1], slots)[-1]
        continuations.append(generated)
    assert all(len(set(g)) >= 8 for g in continuations), continuations
    assert len({tuple(g[:4]) for g in continuations}) == len(continuations), continuations


@torch.no_grad()
def test_batch_invariant_rows_are_bit_identical() -> None:
    """With batch invariance a token's logits do not depend on how its sequence was chunked or
    what else shares the batch (torch's own matmul/SDPA differ in the last bits)."""
    _, model = build_model("tiny", DEVICE, DTYPE, seed=0, batch_invariant=True)
    tokens = prompt(20)
    slots = torch.arange(len(tokens))
    whole = run_chunks(model, DenseKVCache(model, 32), tokens, [20], slots)[-1]
    chunked = run_chunks(model, DenseKVCache(model, 32), tokens, [7, 5, 8], slots)[-1]
    decoded = run_chunks(model, DenseKVCache(model, 32), tokens, [12] + [1] * 8, slots)[-1]
    assert torch.equal(whole, chunked) and torch.equal(whole, decoded)
    # the same request next to another in one ragged batch
    other = prompt(9, seed=9)
    cache = DenseKVCache(model, 64)
    seqs = [(other, 0, torch.arange(32, 41)), (tokens, 0, slots)]
    assert torch.equal(model(ForwardBatch.build(seqs, DEVICE), cache)[1], whole)
    torch.testing.assert_close(whole, reference_logits(model, tokens)[-1], atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(("preset", "tied"), [("tiny", False), ("tiny", True), ("tiny-tp", False)])
def test_float32_weights_are_prepacked_for_onednn_and_give_the_same_logits(
    preset: str, tied: bool
) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    config = PRESETS[preset].replace(tie_word_embeddings=tied)
    plain = create_model(config, DEVICE, torch.float32)
    init_random_weights(plain, seed=3)
    packed = copy.deepcopy(plain)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert packed.prepack_weights() == len(linears) + tied
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert (packed.packed_logits is not None) == tied

    def logits(model: LlamaModel) -> list[torch.Tensor]:
        cache = DenseKVCache(model, 64)
        cache.kv = cache.kv.float()
        return run_chunks(model, cache, prompt(40), [24, 8] + [1] * 8, torch.arange(40))

    want, got = logits(plain), logits(packed)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)  # float32 sums in another order
        assert a.argmax() == b.argmax()
    # The batch-invariant path multiplies plain weights: switching it on unpacks them exactly.
    packed.set_batch_invariant(True)
    assert packed.packed_logits is None
    for (name, a), b in zip(packed.named_parameters(), plain.parameters(), strict=True):
        assert not a.is_mkldnn and torch.equal(a, b), name


def test_models_are_built_prepacked_except_in_float64_or_batch_invariant() -> None:
    _, fast = build_model("tiny", DEVICE, torch.float32)
    assert fast.layers[0].mlp.down_proj.weight.is_mkldnn == torch.backends.mkldnn.is_available()
    _, wide = build_model("tiny", DEVICE, torch.float64)
    _, invariant = build_model("tiny", DEVICE, torch.float32, batch_invariant=True)
    for model in (wide, invariant):
        assert model.prepack_weights() == 0
        assert not any(p.is_mkldnn for p in model.parameters())
