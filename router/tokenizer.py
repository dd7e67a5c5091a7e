"""Text <-> token ids for the router.

This repeats a small piece of `gpu_worker/model/tokenizer.py` on purpose: the router must
not depend on gpu_worker (DESIGN.md section 1). The two must agree: UTF-8 bytes are ids 0..255 and
ids from 256 on are special tokens; a `tokenizer.json` goes through the `tokenizers` library,
which adds BOS only when the file's own post-processor does (as the engine's loader).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """Special tokens are dropped; a cut-off UTF-8 sequence at the end becomes U+FFFD."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ids outside that range decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok = tok

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        """`path` is a tokenizer.json file or a directory holding one."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        return cls(tokenizers.Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer.from_path(path)
