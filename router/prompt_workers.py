"""Prompt text -> token ids in worker processes, so that the router's event loop never runs
unbounded work for one request (DESIGN.md 7b).

A request's text prompt (completions' `prompt`, `/generate`'s `text`) is tokenized, and a
chat request's messages are rendered by the model's chat template and then tokenized, in one
of `num_workers` worker processes (`--tokenizer-worker-num`), never on the event loop. The
request has already passed the character limit (`router.protocol.prompt_text`), so the
tokenizer's work is linear in a bounded length; the template's is not: a chat template is a
program the model card brings (an engine on the bus chose it), and a few lines of Jinja can
loop 10**10 times without writing a character, or build a string of 10**8 characters.

Why processes: a Python thread cannot be stopped, and a sandbox cannot count every step. A
budget inside Jinja (a capped `range`, output streamed with a deadline between chunks) stops
some templates, but not `{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}` over a
long string (no call, no output, nothing to check between iterations), nor `x ~ x` doubling
a string, and a thread that spins holds a core and the GIL for ever. A process is killed:
each job has `timeout_s` of the worker's time (`--tokenize-timeout`), after which its worker is
killed (SIGKILL) and a fresh one started, and each worker's address space is capped
(`RLIMIT_AS`, `memory_bytes` beyond what it holds after start), so memory is bounded too.
Inside that bound the template's output is also cut at a budget (`ChatTemplate.render`), so
the common runaway, a template that writes without end, is refused early and cheaply.

Any failure of a job is the request's: a 400 that names the model's chat template
(`chat_template_error`) or the prompt (`tokenize_timeout`, `tokenize_failed`), never a 500;
a template that does not compile stays a 500 (`chat_template_unusable`: the model card is
wrong, not the request).

A worker holds the `ServedModel`s it was sent (tokenizer and compiled template, by the card's
`speech_digest`, the `MODELS_PER_WORKER` most recent); it asks for a card it lacks (`need_card`), so a
card of a few MB crosses the pipe once per worker. Workers start on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from subprocess import DEVNULL
from typing import Any

from bus_schemas.token_ids import TokenIds, as_token_ids
from router.chat import ChatMessage, ChatTemplateError
from router.errors import ApiError, bad_request
from router.models import ServedModel, served_model

log = logging.getLogger(__name__)

MODELS_PER_WORKER = 8  # model cards a worker keeps built (most recently used)
# a worker's start (Python and its imports) and a card's build (a large vocabulary) are not
# the request's doing, and take seconds on a loaded machine: they have limits of their own
START_TIMEOUT_S = 60.0
CARD_TIMEOUT_S = 30.0
WORKER_MEMORY_BYTES = 2 * 1024**3  # address space a worker may add after it started
TEMPLATE_OVERHEAD_CHARS = 64 * 1024  # a rendered chat prompt may exceed its messages by this


@dataclass(frozen=True, slots=True)
class PromptText:
    """A request's prompt given as text, not yet tokenized."""

    param: str  # the field it came from: "prompt", "text" or "messages"
    text: str = ""  # completions and /generate
    messages: tuple[ChatMessage, ...] = ()  # chat: rendered by the model's template first
    # refuse text holding a special token's string (`--refuse-special-tokens`): else it is
    # tokenized as that control token, as Hugging Face does
    refuse_special: bool = False

    @property
    def chat(self) -> bool:
        return self.param == "messages"


class SpecialTokenInText(ValueError):
    """The prompt's text holds a special token's string, and the router refuses those."""


def encode_prompt(model: ServedModel, prompt: PromptText, max_chars: int | None) -> TokenIds:
    """`prompt`'s token ids under `model`. Raises `ChatTemplateError` (the template refused,
    failed, or wrote more than `max_chars` + `TEMPLATE_OVERHEAD_CHARS`), `SpecialTokenInText`
    and ValueError (the template does not compile). Runs in a worker (`PromptWorkers`), or
    inline in tests."""
    if prompt.refuse_special:
        _check_no_special(model, prompt)
    if prompt.chat:
        budget = None if max_chars is None else max_chars + TEMPLATE_OVERHEAD_CHARS
        text = model.render_chat(prompt.messages, budget)
        return as_token_ids(model.tokenizer.encode(text, add_special_tokens=False))
    return as_token_ids(model.tokenizer.encode(prompt.text))


def _check_no_special(model: ServedModel, prompt: PromptText) -> None:
    texts = [m.content for m in prompt.messages] if prompt.chat else [prompt.text]
    for special in model.tokenizer.special_texts():
        for i, text in enumerate(texts):
            if special in text:
                where = f"messages[{i}].content" if prompt.chat else f"'{prompt.param}'"
                raise SpecialTokenInText(
                    f"{where} holds {special!r}, a special token of model {model.name!r}: "
                    "this server refuses special tokens in text (--refuse-special-tokens)"
                )


class PromptWorkers:
    """The one owner of the prompt worker processes. `await encode(...)`; `close()` when done.

    Concurrency is `num_workers` jobs; more requests wait for a free worker (the wait is not
    counted in `timeout_s`)."""

    def __init__(
        self, num_workers: int, timeout_s: float, memory_bytes: int = WORKER_MEMORY_BYTES
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._workers = [_Worker(i, memory_bytes) for i in range(num_workers)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in self._workers:
            self._idle.put_nowait(w)
        # one thread per worker blocks on its pipe (send, then the reply)
        self._io = ThreadPoolExecutor(num_workers, thread_name_prefix="prompt-io")
        self._jobs: set[asyncio.Task[TokenIds]] = set()
        self.restarts = 0  # workers killed (timeout) or found dead, and replaced

    async def encode(self, model: ServedModel, prompt: PromptText, max_chars: int) -> TokenIds:
        """`prompt`'s token ids, or an ApiError (400 for anything the prompt or template did).
        A caller that is cancelled leaves the job to finish (or be killed) on its own."""
        worker = await self._idle.get()
        job = asyncio.create_task(self._run(worker, model, prompt, max_chars), name="prompt-job")
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return await asyncio.shield(job)

    async def close(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        for job in list(self._jobs):
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await job
        loop = asyncio.get_running_loop()
        for w in self._workers:
            w.kill()
            await loop.run_in_executor(None, w.reap)
        self._io.shutdown(wait=False, cancel_futures=True)

    async def _run(
        self, worker: _Worker, model: ServedModel, prompt: PromptText, max_chars: int
    ) -> TokenIds:
        """One job on `worker`, which goes back to the idle queue after (killed, if it ran
        past the timeout or the job was cancelled: a fresh one starts on next use)."""
        loop = asyncio.get_running_loop()
        key = model.speech or model.digest
        try:
            if not worker.alive:
                await loop.run_in_executor(None, worker.start)
                await self._ask(worker, None, START_TIMEOUT_S)  # its ("ready",)
            reply = await self._ask(worker, (key, None, prompt, max_chars))
            if reply[0] == "need_card":
                timeout_s = max(self.timeout_s, CARD_TIMEOUT_S)
                reply = await self._ask(worker, (key, model.card, prompt, max_chars), timeout_s)
        except asyncio.CancelledError:
            worker.kill()
            raise
        except TimeoutError:
            await self._replace(worker, "ran past its time limit")
            raise _timeout_error(model, prompt, self.timeout_s) from None
        except (EOFError, OSError) as e:
            await self._replace(worker, f"died ({e!r})")
            raise _failed_error(model, prompt, "the worker that ran it died") from None
        finally:
            self._idle.put_nowait(worker)
        return _result(model, prompt, reply)

    async def _ask(
        self, worker: _Worker, job: tuple[Any, ...] | None, timeout_s: float | None = None
    ) -> tuple[Any, ...]:
        """Send `job` (None: nothing, only wait), wait at most `timeout_s` (default: the
        job limit) for the reply (TimeoutError past it)."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._io, worker.ask, job)
        done, _ = await asyncio.wait({fut}, timeout=timeout_s or self.timeout_s)
        if not done:
            worker.kill()  # the blocked thread sees the pipe close and returns
            with contextlib.suppress(EOFError, OSError):
                await fut
            raise TimeoutError
        return fut.result()

    async def _replace(self, worker: _Worker, why: str) -> None:
        self.restarts += 1
        log.warning("prompt worker %d %s: killed, a new one starts on next use", worker.index, why)
        worker.kill()
        await asyncio.get_running_loop().run_in_executor(None, worker.reap)


def _result(model: ServedModel, prompt: PromptText, reply: Sequence[Any]) -> TokenIds:
    kind = reply[0]
    if kind == "ok":
        return as_token_ids(reply[1])
    message = str(reply[1])
    if kind == "template":
        raise bad_request(
            f"{message} (the chat template of model {model.name!r})",
            "messages",
            "chat_template_error",
        )
    if kind == "special":
        raise bad_request(message, prompt.param, "special_token_in_text")
    if kind == "unusable":
        raise ApiError(500, message, code="chat_template_unusable")
    raise _failed_error(model, prompt, message)


def _timeout_error(model: ServedModel, prompt: PromptText, timeout_s: float) -> ApiError:
    if prompt.chat:
        return bad_request(
            f"the chat template of model {model.name!r} did not finish "
            f"rendering the messages within {timeout_s:g} s",
            "messages",
            "chat_template_error",
        )
    return bad_request(
        f"tokenizing '{prompt.param}' took longer than {timeout_s:g} s",
        prompt.param,
        "tokenize_timeout",
    )


def _failed_error(model: ServedModel, prompt: PromptText, why: str) -> ApiError:
    if prompt.chat:
        return bad_request(
            f"the chat template of model {model.name!r} failed on the messages: {why}",
            "messages",
            "chat_template_error",
        )
    return bad_request(
        f"'{prompt.param}' could not be tokenized: {why}", prompt.param, "tokenize_failed"
    )


class _Worker:
    """One worker process (`python -m router.prompt_workers`) and the router's end of the
    socket pair it serves on. A plain subprocess, not a `multiprocessing` spawn: that would
    re-import whatever main module the embedding program has."""

    def __init__(self, index: int, memory_bytes: int) -> None:
        self.index = index
        self.memory_bytes = memory_bytes
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.reap()
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), str(self.memory_bytes)]
        root = str(Path(__file__).resolve().parents[1])  # where `router` is, wherever we run
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = os.environ | {"PYTHONPATH": path}
        try:
            self.process = subprocess.Popen(
                argv, pass_fds=(theirs.fileno(),), stdin=DEVNULL, env=env
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def ask(self, job: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Send one job (unless None) and block for its reply (in an I/O thread)."""
        assert self.conn is not None
        if job is not None:
            self.conn.send(job)
        reply: tuple[Any, ...] = self.conn.recv()
        return reply

    def kill(self) -> None:
        if self.alive:
            assert self.process is not None
            self.process.kill()

    def reap(self) -> None:
        """Wait for a killed process and drop it (blocking: run in a thread)."""
        if self.process is not None:
            self.kill()
            self.process.wait(5)
            self.process = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# ------------------------------------------------------------------ the worker process


def _serve_jobs(conn: Connection, memory_bytes: int) -> None:
    """A worker's loop: (speech digest, card or None, PromptText, max_chars) -> a reply tuple:
    ("ok", id bytes) | ("need_card",) | ("template" | "unusable" | "error", message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the router's to handle
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the pool is the parallelism
    os.environ["RAYON_NUM_THREADS"] = "1"
    _limit_memory(memory_bytes)
    conn.send(("ready",))
    models: OrderedDict[str, ServedModel] = OrderedDict()
    while True:
        try:
            digest, card, prompt, max_chars = conn.recv()
        except (EOFError, OSError):
            return  # the router closed the pipe, or exited
        try:
            reply = _job(models, digest, card, prompt, max_chars)
        except MemoryError:
            reply = ("error", f"it needed more than the worker's {memory_bytes >> 20} MiB")
        conn.send(reply)


def _job(
    models: OrderedDict[str, ServedModel],
    digest: str,
    card: Any,
    prompt: PromptText,
    max_chars: int,
) -> tuple[Any, ...]:
    model = models.get(digest)
    if model is None:
        if card is None:
            return ("need_card",)
        try:
            model = served_model(card)
        except ValueError as e:
            return ("unusable", str(e))
        models[digest] = model
        while len(models) > MODELS_PER_WORKER:
            models.popitem(last=False)
    models.move_to_end(digest)
    try:
        return ("ok", encode_prompt(model, prompt, max_chars).tobytes())
    except SpecialTokenInText as e:
        return ("special", str(e))
    except ChatTemplateError as e:
        return ("template", str(e))
    except ValueError as e:
        return ("unusable", str(e))
    except MemoryError:
        raise
    except Exception as e:  # the tokenizer library raises its own types
        return ("error", f"{type(e).__name__}: {e}")


def _limit_memory(extra_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus `extra_bytes`."""
    try:
        with open("/proc/self/status") as f:
            vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return  # not Linux: no cap (the time limit still holds)
    limit = vm_kb * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":  # the worker: run this module's own copy, not __main__'s
    from router import prompt_workers

    prompt_workers._serve_jobs(Connection(int(sys.argv[1])), int(sys.argv[2]))
