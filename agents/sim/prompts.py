"""The simulator's tokenizer and chat template: a request's prompt as the token sequence an
engine would see, which both prices it (``usage.prompt_tokens``, ``POST /tokenize``) and keys
the prefix cache.

A token is a whitespace-separated word. The template renders the messages in order, each one's
content followed by four marker tokens: the end of that message (naming its role), the start of
the next turn, the next turn's role and the end of its header. After the last message the next
turn is the assistant's, so those four markers end with the generation prompt. Laid out like
that, a chat costs its words plus ``MESSAGE_OVERHEAD_TOKENS`` per message, and the rendering of
a history is a prefix of the rendering of that history continued: the next turn, which resends
the answer as an assistant message, begins with the previous prompt and the answer's tokens,
exactly as an engine's sequence of prompt and generated tokens ran (so the blocks filled while
decoding are hit too, as on vLLM). The request's ``tools`` go where Qwen's and Hermes' templates
put them: inside the leading system message after its text, or in a system message of their own
before the first message.

Markers contain a space, so no word of any content can be mistaken for one. The template's
opening (a real one's BOS and first header) is not priced, so counts stay one per word plus the
markers, but it keys the cache: a rendered prompt's first block hangs from ``TEMPLATE_ROOT``,
so a chat never shares blocks with a plain completion of the same words.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

MESSAGE_OVERHEAD_TOKENS: Final = 4
TEMPLATE_ROOT: Final = hash(("<|begin of a chat template|>",))  # the parent of its first block
_START: Final = "<|start of turn|>"
_HEADER_END: Final = "<|header end|>"
_EMPTY: Final = "<|empty prompt|>"  # a completions prompt of whitespace still costs a token


def _markers(role: str, following: str) -> tuple[str, str, str, str]:
    """The four markers after a ``role`` turn's content, opening a ``following`` turn."""
    known = _KNOWN_MARKERS.get((role, following))
    if known is not None:
        return known
    return (f"<|end of {role}|>", _START, f"<|role {following}|>", _HEADER_END)


_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")
# Built once, so a prompt's markers are the same strings every time (and hash once).
_KNOWN_MARKERS: Final = {
    (role, following): (f"<|end of {role}|>", _START, f"<|role {following}|>", _HEADER_END)
    for role in _ROLES
    for following in _ROLES
}


def count_text_tokens(text: str) -> int:
    """The prompt cost of a text: its whitespace-separated words."""
    return len(text.split())


def content_words(content: object) -> list[str]:
    """The words of a message's content (a string or a list of parts): what it costs."""
    if isinstance(content, str):
        return content.split()
    words: list[str] = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, str):
            words += part.split()
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            words += part["text"].split()
    return words


def _json_words(value: object) -> list[str]:
    return json.dumps(value, ensure_ascii=False, default=str).split()


def _message_words(message: dict[str, Any], content_key: str = "content") -> list[str]:
    words = content_words(message.get(content_key))
    calls = message.get("tool_calls")
    if isinstance(calls, list):  # an assistant turn that called tools: its calls, as JSON
        for call in calls:
            if isinstance(call, dict):
                words += _json_words(call.get("function", call))
    return words


def _render(turns: Sequence[tuple[str, list[str]]], tools: object) -> list[str]:
    """Each turn's words and markers, the tools in the leading system turn, then the
    generation prompt."""
    turns = list(turns)
    if isinstance(tools, list) and tools:
        if turns and turns[0][0] == "system":
            turns[0] = ("system", turns[0][1] + _json_words(tools))
        else:
            turns.insert(0, ("system", _json_words(tools)))
    tokens: list[str] = []
    for index, (role, words) in enumerate(turns):
        following = turns[index + 1][0] if index + 1 < len(turns) else "assistant"
        tokens += words
        tokens += _markers(role, following)
    return tokens


def _role_of(message: dict[str, Any], default: str) -> str:
    role = message.get("role")
    return role if isinstance(role, str) else default


def chat_tokens(messages: Sequence[object], tools: object = None) -> list[str]:
    """The tokens of a chat prompt: the messages (not objects are skipped), tools, and the
    generation prompt."""
    turns = [(_role_of(m, "user"), _message_words(m)) for m in messages if isinstance(m, dict)]
    return _render(turns, tools)


def responses_tokens(instructions: object, items: object, tools: object = None) -> list[str]:
    """The Responses API's input rendered like a chat: the instructions are the system turn,
    a string input one user turn, and each item a turn (its ``content``, or a tool's
    ``output``)."""
    turns: list[tuple[str, list[str]]] = []
    if isinstance(instructions, str):
        turns.append(("system", instructions.split()))
    if isinstance(items, str):
        turns.append(("user", items.split()))
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            key = "content" if "content" in item else "output"
            default = "tool" if key == "output" else "user"
            turns.append((_role_of(item, default), _message_words(item, key)))
    return _render(turns, tools)


def text_tokens(prompt: str) -> list[str]:
    """A completions prompt: its words (one token even when it has none)."""
    return prompt.split() or [_EMPTY]


def id_tokens(ids: Sequence[int]) -> list[str]:
    """A prompt given as token ids."""
    return [str(i) for i in ids]


def count_chat_prompt_tokens(messages: Sequence[object], tools: object = None) -> int:
    """Words of every message's content (strings or lists of parts) plus a per-message cost,
    plus the words of the tools (and a system message's cost when there is none to hold them)."""
    return len(chat_tokens(messages, tools))


def count_responses_input_tokens(instructions: object, items: object) -> int:
    """The Responses API's input priced like chat: instructions and each item are messages."""
    return len(responses_tokens(instructions, items))


_OUTPUT: list[str] = []


def output_tokens(start: int, end: int) -> list[str]:
    """Generated tokens ``start`` to ``end`` (0-based, end excluded) as words:
    ``output_tokens(0, 3) == ["tok1", "tok2", "tok3"]``."""
    while len(_OUTPUT) < end:
        _OUTPUT.append(f"tok{len(_OUTPUT) + 1}")
    return _OUTPUT[start:end]
