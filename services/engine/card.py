"""The engine's model card: what the router needs to speak the served model's language."""

from __future__ import annotations

from pathlib import Path

from bus_schemas import ModelCard
from gpu_worker.engine.engine import Engine
from gpu_worker.model.tokenizer import HFTokenizer, load_chat_template


def build_card(
    engine: Engine, served_model_name: str, chat_template_file: Path | None
) -> ModelCard:
    """The card of `engine`: its tokenizer as a `tokenizers` JSON (or "bytes" for the
    random-weight presets), its chat template (`--chat-template FILE` first, then the
    model's own), eos ids (with the template's end of turn), context length and names."""
    tok = engine.tokenizer
    if chat_template_file is not None:
        try:
            template: str | None = chat_template_file.read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {chat_template_file}: {e.strerror}") from None
    else:
        template = load_chat_template(engine.config.model)
    mc = engine.model_config
    as_json = tok.tok.to_str() if isinstance(tok, HFTokenizer) else ""
    return ModelCard(
        served_model_name or engine.config.model,
        engine.config.model,
        "json" if as_json else "bytes",
        as_json,
        template,
        list(mc.eos_token_ids),
        mc.bos_token_id,
        engine.context_len,
        mc.vocab_size,
    )
