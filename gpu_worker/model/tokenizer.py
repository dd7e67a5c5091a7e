"""Text <-> token ids: a byte-level tokenizer for the presets, or a checkpoint's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from gpu_worker.model.config import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
from gpu_worker.model.gguf import gguf_path, gguf_tokenizer_json, read_gguf_meta


class Tokenizer(Protocol):
    """What the serving path needs from a tokenizer.

    `encode` never adds BOS by itself unless the tokenizer's own post-processor does (an HF
    tokenizer.json may); `decode` drops special tokens.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS/EOS are the ids after them (see config.py)."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_token_ids = (BYTE_EOS_ID,)
    bos_token_id = BYTE_BOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Special and out-of-range ids are dropped; invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` library."""

    def __init__(
        self, tok: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...], bos_token_id: int | None
    ) -> None:
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load `path/tokenizer.json`; EOS/BOS ids come from generation_config.json, then
        config.json, then the token strings in tokenizer_config.json."""
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        eos = _special_id(path, tok, "eos")
        bos = _special_id(path, tok, "bos")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(tok, eos_ids, bos if isinstance(bos, int) else None)

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """A GGUF's own tokenizer (preset or file), a directory's tokenizer.json, else the byte
    tokenizer of the random-weight presets."""
    gguf = gguf_path(name_or_path)
    if gguf is not None:
        meta = read_gguf_meta(gguf)
        tok = tokenizers.Tokenizer.from_str(gguf_tokenizer_json(gguf))
        config = meta.model_config()
        return HFTokenizer(tok, config.eos_token_ids, config.bos_token_id)
    path = Path(name_or_path)
    if (path / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(path)
    return ByteTokenizer()


def load_chat_template(name_or_path: str | Path) -> str | None:
    """The model's own chat template: a GGUF's `tokenizer.chat_template`, or the
    `chat_template` of a checkpoint directory's tokenizer_config.json (a string, or the one
    named "default" of a list); None for the random-weight presets."""
    gguf = gguf_path(name_or_path)
    if gguf is not None:
        return read_gguf_meta(gguf).chat_template
    template = _read_json(Path(name_or_path) / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_id(path: Path, tok: tokenizers.Tokenizer, kind: str) -> int | list[int] | None:
    """`{kind}_token_id` from the first config file that sets it, else the id of the
    `{kind}_token` string in tokenizer_config.json."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get(f"{kind}_token_id")
        if value is not None:
            return value
    token = _read_json(path / "tokenizer_config.json").get(f"{kind}_token")
    if isinstance(token, dict):  # {"content": "</s>", ...}
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}
