"""The served models, from the model cards engines publish (DESIGN.md section 7).

Every heartbeat carries the digest of its engine's `ModelCard` (tokenizer, chat template,
eos ids, context length, served name). The first heartbeat naming a digest this router does
not hold makes it ask that engine for the card (request/reply on
`subjects.engine_model_card`); the card is checked against the digest, and turned into a
`ServedModel`: the tokenizer and the compiled chat template that every request for that
model is parsed with. Cards are kept by digest, so engines of one model share one
`ServedModel`, and an engine restarted with another tokenizer or template (a new digest)
gets its own: a request is tokenized with one card and only goes to engines of that card.

A fetch that fails (no reply, a malformed card, a digest mismatch) is counted
(`bus_errors{kind="model_card"}`), logged (one line per interval, `LogThrottle`), and asked
again on a later heartbeat, at most once per `RETRY_S`. Until a card arrives its engines are
not routed to (a 503 names the model).

Bounded (DESIGN.md 7b: any engine names any digest): at most `max_cards` cards are held (the
one named least recently by a heartbeat or used by a request goes first, and is fetched again
when named again), at most `MAX_FETCHES` fetches run at once and at most `FETCHES_PER_S` start
per second (a heartbeat whose fetch finds no room asks again with its next heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jinja2
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError

from bus_schemas import ModelCard, ModelCardRequest, SchemaError, subjects
from bus_schemas.throttle import LogThrottle
from router.chat import ChatMessage, ChatTemplate
from router.metrics import RouterMetrics
from router.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

RETRY_S = 1.0  # least time between two fetches of one digest
FETCH_TIMEOUT_S = 5.0  # a tokenizer JSON can be a few MB
MAX_FETCHES = 4  # card fetches in flight at once
FETCHES_PER_S = 10.0  # card fetches started per second (a burst of as many)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model card, ready to parse requests with."""

    card: ModelCard
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the card's template does not compile
    template_error: str = ""  # why it does not
    speech: str = ""  # `card.speech_digest`, computed once (the tokenizer JSON can be MBs)

    @property
    def name(self) -> str:
        return self.card.served_model_name

    @property
    def digest(self) -> str:
        return self.card.digest

    def render_chat(self, messages: Sequence[ChatMessage], max_chars: int | None = None) -> str:
        """Raises `ChatTemplateError` when the template refuses the messages (or writes more
        than `max_chars`), and `ValueError` when the model's template does not compile."""
        if self.chat_template is None:
            raise ValueError(
                f"model {self.name!r} has no usable chat template: {self.template_error}"
            )
        return self.chat_template.render(messages, max_chars)


def served_model(card: ModelCard) -> ServedModel:
    """Build the tokenizer and compile the template of `card` (ValueError for a tokenizer
    that does not load)."""
    tok: Tokenizer
    if card.tokenizer == "json":
        try:
            tok = HFTokenizer.from_json(card.tokenizer_json)
        except Exception as e:  # the tokenizers library raises its own types
            raise ValueError(f"the tokenizer of model card {card.digest} does not load: {e}") from e
    else:
        tok = ByteTokenizer()
    bos = tok.token_text(card.bos_token_id) if card.bos_token_id is not None else None
    eos = tok.token_text(card.eos_token_ids[0]) if card.eos_token_ids else None
    try:
        template = ChatTemplate(card.chat_template, bos or "", eos or "")
    except jinja2.TemplateError as e:
        log.warning("the chat template of model %r does not compile: %s", card.served_model_name, e)
        return ServedModel(card, tok, None, f"{type(e).__name__}: {e}", card.speech_digest)
    return ServedModel(card, tok, template, speech=card.speech_digest)


class ModelCards:
    """The one owner of the router's model cards. `close()` when done."""

    def __init__(
        self,
        nc: NatsClient,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        timeout_s: float = FETCH_TIMEOUT_S,
        max_cards: int = 64,
    ) -> None:
        self.nc = nc
        self.metrics = metrics
        self.clock = clock
        self.timeout_s = timeout_s
        self.max_cards = max_cards
        self._models: OrderedDict[str, ServedModel] = OrderedDict()  # least recent first
        self._asked: dict[str, float] = {}  # digest -> clock of its last fetch
        self._tasks: set[asyncio.Task[None]] = set()
        self._tokens = FETCHES_PER_S  # the fetch rate's bucket
        self._refilled = clock()
        self._throttle = LogThrottle(log)

    def get(self, digest: str) -> ServedModel | None:
        model = self._models.get(digest)
        if model is not None:
            self._models.move_to_end(digest)
        return model

    def speaking(self, model: ServedModel) -> frozenset[str]:
        """The card digests held here that parse requests as `model` does (they differ at
        most in the context length: engines of one model in buckets of other lengths)."""
        return frozenset(d for d, m in self._models.items() if m.speech == model.speech)

    def observe(self, engine_id: str, digest: str) -> None:
        """A heartbeat of `engine_id` named `digest`: fetch that card if it is new."""
        if not digest:
            return
        if digest in self._models:
            self._models.move_to_end(digest)
            return
        now = self.clock()
        if now - self._asked.get(digest, float("-inf")) < RETRY_S:
            return  # being fetched, or failed a moment ago
        if not self._may_fetch(now):
            self.metrics.bus_errors.labels("model_card_deferred").inc()
            return
        self._asked[digest] = now
        task = asyncio.create_task(self._fetch(engine_id, digest), name=f"model-card-{digest}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _may_fetch(self, now: float) -> bool:
        """Room for one more fetch (in flight, and by rate); takes it when there is."""
        self._tokens = min(FETCHES_PER_S, self._tokens + (now - self._refilled) * FETCHES_PER_S)
        self._refilled = now
        if len(self._tasks) >= MAX_FETCHES or self._tokens < 1:
            return False
        self._tokens -= 1
        if len(self._asked) > 4 * self.max_cards:  # forget fetches long over
            self._asked = {d: t for d, t in self._asked.items() if now - t < RETRY_S}
        return True

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _fetch(self, engine_id: str, digest: str) -> None:
        subject = subjects.engine_model_card(engine_id)
        try:
            msg = await self.nc.request(
                subject, ModelCardRequest().encode(), timeout=self.timeout_s
            )
            card = ModelCard.decode(msg.data)
            if card.digest != digest:
                raise ValueError(f"its digest is {card.digest}, the heartbeat said {digest}")
            model = await asyncio.to_thread(served_model, card)  # a large vocabulary: ms
        except (NatsError, TimeoutError, SchemaError, ValueError) as e:
            self.metrics.bus_errors.labels("model_card").inc()
            self._throttle.warning("fetch", "no model card from engine %s: %s", engine_id, e)
            return
        self._models[digest] = model
        while len(self._models) > self.max_cards:
            gone, _ = self._models.popitem(last=False)
            log.info(
                "model card %s dropped: %d cards held (--max-model-cards)", gone, self.max_cards
            )
        self._asked.pop(digest, None)
        log.info(
            "model %r (card %s, tokenizer %s) from engine %s",
            model.name,
            digest,
            model.card.tokenizer,
            engine_id,
        )
