"""Text <-> token ids for the router, built from an engine's model card (`router.models`).

The router never imports `gpu_worker` (DESIGN.md section 1): an engine publishes its
tokenizer on the bus (a `tokenizers` JSON, or "bytes" for the random-weight presets) and the
router builds the same tokenizer here, so prompt ids and output text are exactly the
model's. The byte tokenizer must agree with the engine's: UTF-8 bytes are ids 0..255, ids
from 256 on are special tokens that decode to nothing.
"""

from __future__ import annotations

from functools import cache
from typing import Protocol

import tokenizers
from tokenizers import decoders


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: let the tokenizer's own post-processor add BOS and the like
        (completions); a rendered chat template already holds its special tokens (False)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Special tokens are dropped; a cut-off UTF-8 sequence at the end becomes U+FFFD."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs show them: a token may hold part of a
        UTF-8 character); a special token's own text."""
        ...

    def token_text(self, token_id: int) -> str | None:
        """A token's text as the vocabulary writes it (templates' `bos_token`), or None."""
        ...

    def special_texts(self) -> tuple[str, ...]:
        """The texts that `encode` turns into special (control) tokens wherever they occur."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ids outside that range decode to nothing."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens  # no BOS: the presets' engine tokenizer adds none either
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def token_text(self, token_id: int) -> str | None:
        del token_id
        return None

    def special_texts(self) -> tuple[str, ...]:
        return ()  # text is only ever bytes


class HFTokenizer:
    """A Hugging Face tokenizer (`tokenizers` JSON)."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok = tok
        self._byte_level = isinstance(tok.decoder, decoders.ByteLevel)

    @classmethod
    def from_json(cls, text: str) -> HFTokenizer:
        return cls(tokenizers.Tokenizer.from_str(text))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()  # an added token, kept as written
        return str(self.tok.decode([token_id], skip_special_tokens=False)).encode()

    def token_text(self, token_id: int) -> str | None:
        piece = self.tok.id_to_token(token_id)
        return None if piece is None else str(piece)

    def special_texts(self) -> tuple[str, ...]:
        added = self.tok.get_added_tokens_decoder().values()
        return tuple(sorted({str(t.content) for t in added if t.special and t.content}))


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: bytes that are printable
    Latin-1 stand for themselves, the other 68 take the code points from 256 on, in byte
    order (GPT-2's scheme, which every byte-level BPE vocabulary uses). The inverse map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table
