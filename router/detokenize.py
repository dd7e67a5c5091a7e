"""Generated ids -> text, incrementally, with stop strings.

Decoding is incremental (only the ids since the last stable point are decoded again), so a
long output costs linear time. A character is final once the decode of the ids after it no
longer ends in U+FFFD (a cut-off UTF-8 sequence). Stop strings are matched on final text;
up to `len(longest stop) - 1` characters are held back while they could still begin a stop
string, so streamed text never shows part of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.tokenizer import Tokenizer


class TextAssembler:
    """Feeds on generated ids one at a time; `release()` hands out text as it becomes safe."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tok = tok
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []  # every id taken, up to the one that completed a stop
        self.text = ""  # final text so far (cut before a matched stop string)
        self.matched = False  # a stop string matched; no more ids are taken
        self._closed = False  # matched or finished: nothing is held back any more
        self._released = 0  # characters of `text` handed out
        self._prefix_offset = 0  # ids before this are decoded for good
        self._read_offset = 0  # ids before this are in `text`

    def push(self, token_id: int) -> bool:
        """Take one id; True when it completed a stop string (the caller aborts)."""
        if self._closed:
            return self.matched
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tok.decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # no final character yet
        start = max(self._released, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._match(start)

    def finish(self) -> None:
        """The engine is done: whatever is still undecided becomes final."""
        if self._closed:
            return
        prefix = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tok.decode(self.ids[self._prefix_offset :])
        start = max(self._released, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self._read_offset = len(self.ids)
        self._match(start)
        self._closed = True

    def release(self) -> str:
        """Text that can no longer change or turn into a stop string, not handed out yet."""
        end = len(self.text) if self._closed else max(self._released, len(self.text) - self.hold)
        out = self.text[self._released : end]
        self._released = end
        return out

    def _match(self, start: int) -> bool:
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.matched = self._closed = True
        return True
