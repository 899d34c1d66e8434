"""Steady client traffic while a test breaks something: clients of the official ``openai``
package, each on a thread of its own, streaming one chat completion after another until told
to stop, and what each of them saw.

An answer is whole when its stream brought every token it asked for and ended as the API says
a stream ends; anything else (an HTTP error, an error event, a stream cut short) is kept with
what the client was told. Times are kept for the report a test prints, never asserted.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import openai

# The openai client logs every request at INFO: thousands of lines in a failing test's output.
for _name in ("httpx", "httpx2", "openai"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it."""

    client: int
    url: str
    began: float  # time.monotonic() when it was sent
    seconds: float  # until its last byte (or its error)
    request_id: str  # the gateway's x-request-id ("" when the answer carried none)
    status: int  # 200, or the HTTP status of the error
    error: str  # "" for a whole answer
    tokens: int  # content chunks received

    @property
    def whole(self) -> bool:
        return self.status == 200 and not self.error


class StreamingClients:
    """``clients`` openai clients streaming ``model`` from the gateways at ``urls`` (client
    i uses ``urls[i % len(urls)]``), ``tokens`` tokens a request, ``itl_ms`` apart."""

    def __init__(
        self,
        urls: Sequence[str],
        key: str,
        model: str,
        *,
        clients: int = 8,
        tokens: int = 16,
        itl_ms: float = 10.0,
    ) -> None:
        self.urls = list(urls)
        self.key = key
        self.model = model
        self.clients = clients
        self.tokens = tokens
        self.itl_ms = itl_ms
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()

    @contextmanager
    def running(self) -> Iterator[StreamingClients]:
        threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            for thread in threads:
                thread.join(180)

    def _client(self, index: int) -> None:
        url = self.urls[index % len(self.urls)]
        client = openai.OpenAI(base_url=url + "/v1", api_key=self.key, max_retries=0, timeout=120)
        try:
            while not self._stop.is_set():
                answer = self._one(client, index, url)
                with self.lock:
                    self.answers.append(answer)
        finally:
            client.close()

    def _one(self, client: openai.OpenAI, index: int, url: str) -> Answer:
        began = time.monotonic()
        request_id, tokens, status, error = "", 0, 200, ""
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": f"client {index}"}],
                max_tokens=self.tokens,
                stream=True,
                extra_body={"sim": {"itl_ms": self.itl_ms}},
            )
            request_id = stream.response.headers.get("x-request-id", "")
            finished = False
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    tokens += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            if not finished or tokens != self.tokens:
                error = f"stream ended after {tokens} of {self.tokens} tokens"
        except openai.APIStatusError as exc:
            status, error = exc.status_code, f"{exc.status_code}: {exc.message}"
            request_id = request_id or exc.response.headers.get("x-request-id", "")
        except Exception as exc:  # every kind counts: the client saw it
            status, error = 0, repr(exc)
        return Answer(
            index, url, began, time.monotonic() - began, request_id, status, error, tokens
        )

    def seen(self, since: float = 0.0, until: float = float("inf")) -> list[Answer]:
        """The answers to requests sent between ``since`` and ``until`` (monotonic)."""
        with self.lock:
            return [a for a in self.answers if since <= a.began < until]

    def count(self, since: float = 0.0) -> int:
        return len(self.seen(since))


def latency_report(name: str, answers: Sequence[Answer]) -> str:
    """One line for the test's output: how many answers and how long they took."""
    if not answers:
        return f"{name}: no answers"
    seconds = sorted(a.seconds for a in answers)
    return (
        f"{name}: {len(answers)} answers, median {statistics.median(seconds) * 1000:.0f} ms, "
        f"max {seconds[-1] * 1000:.0f} ms"
    )
