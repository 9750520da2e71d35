"""Prompt files -> `Conversation`s. Formats: Spec-Bench / MT-Bench (`turns`), ShareGPT (`conversations`),
OpenAI `messages`, plain `prompt`; JSONL or a JSON array. A file is loaded whole or refused whole, with every
problem named by file and line."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

FORMATS = ("specbench", "sharegpt", "messages", "prompt")
FORMAT_KEYS = {"specbench": ("question_id", "turns"), "sharegpt": ("id", "conversations"),
               "messages": ("messages",), "prompt": ("prompt",)}
DETECT_KEY = {"turns": "specbench", "conversations": "sharegpt", "messages": "messages", "prompt": "prompt"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
MESSAGE_ROLES = ("system", "user", "assistant")
MAX_LISTED = 10
_WS = re.compile(r"\s*")


class WorkloadError(ValueError):
    """A prompt set that cannot be used."""


class RowError(ValueError):
    """One row that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Conversation:
    """One workload item. `prefix` is sent before the first live user turn (system message or an OpenAI
    history); `user_turns` are sent one after another, each after the model's own answer to the previous;
    `raw_prompt` is plain text sent without the chat template (then `user_turns` is empty)."""

    id: str
    category: str
    prefix: tuple[dict, ...]
    user_turns: tuple[str, ...]
    raw_prompt: str | None
    source: str

    @property
    def num_turns(self) -> int:
        return 1 if self.raw_prompt is not None else len(self.user_turns)

    def content(self) -> dict:
        """Everything a server sees (no `source`: the same prompts from another path are the same workload)."""
        d = asdict(self)
        d.pop("source")
        d["prefix"], d["user_turns"] = list(d["prefix"]), list(d["user_turns"])
        return d

    def first_turns(self, n: int) -> Conversation:
        return Conversation(self.id, self.category, self.prefix, self.user_turns[:n], self.raw_prompt, self.source)


@dataclass(frozen=True)
class Row:
    value: object
    source: str  # "file:line"
    where: str   # for error messages: "file:line", or "file:line (element i)" in a JSON array


def refuse(what: str, problems: list[str]) -> WorkloadError:
    listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED])
    more = f"\n  - and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return WorkloadError(f"{what}: {len(problems)} problem(s), nothing loaded:\n{listed}{more}")


def _json_error(path: Path, err: json.JSONDecodeError, hint: str) -> WorkloadError:
    return WorkloadError(f"{path}:{err.lineno}:{err.colno}: malformed JSON ({err.msg}); {hint}")


def iter_array(text: str, name: str, truncated_ok: bool = False) -> Iterator[tuple[int, int, object]]:
    """(element index, line, value) of a JSON array, element by element (the line of each is kept). With
    `truncated_ok` an unterminated last element ends the array instead of refusing the file."""
    dec = json.JSONDecoder()
    pos, line, counted, index = _WS.match(text, text.index("[") + 1).end(), 1, 0, 0
    if text.startswith("]", pos):
        return
    while True:
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            value, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if truncated_ok and not text.rstrip().endswith("]"):
                return
            raise _json_error(Path(name), err, f"element {index} of the JSON array") from None
        yield index, line, value
        index += 1
        pos = _WS.match(text, pos).end()
        if text.startswith("]", pos):
            return
        if not text.startswith(",", pos):
            lineno = text.count("\n", 0, pos) + 1
            raise WorkloadError(f"{name}:{lineno}: expected ',' or ']' after element {index - 1} of the JSON array")
        pos = _WS.match(text, pos + 1).end()


def read_rows(path: Path) -> list[Row]:
    """JSONL (one object per line, blank lines allowed) or a JSON array (first non-space character `[`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError(f"{path}: cannot read the prompt file ({err})") from None
    if text.lstrip().startswith("["):
        return [Row(v, f"{path}:{line}", f"{path}:{line} (element {i})") for i, line, v in iter_array(text, str(path))]
    rows = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rows.append(Row(json.loads(raw), f"{path}:{n}", f"{path}:{n}"))
        except json.JSONDecodeError as err:
            raise WorkloadError(f"{path}:{n}:{err.colno}: malformed JSON ({err.msg}); JSONL needs one complete "
                                "JSON object per line (or make the file one JSON array)") from None
    return rows


def detect_format(row: Row) -> str:
    value = row.value
    if isinstance(value, dict):
        for key, fmt in DETECT_KEY.items():
            if key in value:
                return fmt
    raise WorkloadError(f"{row.where}: cannot detect the format: {_shape(value)}; {_needs()}")


def _shape(value: object) -> str:
    if isinstance(value, dict):
        return f"the row has keys {sorted(value)}"
    return f"the row is a JSON {type(value).__name__}, not an object"


def _needs() -> str:
    return "formats need: " + "; ".join(f"{f}: {', '.join(keys)}" for f, keys in FORMAT_KEYS.items())


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{what} is empty")
    return value


def _optional_str(row: dict, key: str, default: str) -> str:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RowError(f"'{key}' must be a string or an integer, got {type(value).__name__}")
    return str(value) if str(value).strip() else default


def _specbench(row: dict, default_id: str, stem: str) -> tuple:
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise RowError("'turns' must be a non-empty list of user messages (strings)")
    user = tuple(_text(t, f"turns[{i}]") for i, t in enumerate(turns))
    return _optional_str(row, "question_id", ""), _optional_str(row, "category", stem), (), user, None


def _sharegpt(row: dict, default_id: str, stem: str) -> tuple:
    entries = row["conversations"]
    if not isinstance(entries, list) or not entries:
        raise RowError("'conversations' must be a non-empty list of {from, value} entries")
    prefix, user = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("from") not in SHAREGPT_ROLES:
            raise RowError(f"conversations[{i}] must be {{from: human|gpt|system, value: str}}, got {entry!r:.80}")
        role = SHAREGPT_ROLES[entry["from"]]
        if role == "system":
            if i:
                raise RowError(f"conversations[{i}] is a system entry; only a leading one is supported")
            prefix.append({"role": "system", "content": _text(entry.get("value"), f"conversations[{i}].value")})
        elif role == "user":
            user.append(_text(entry.get("value"), f"conversations[{i}].value"))
        elif not user:
            raise RowError(f"conversations[{i}] is from {entry['from']!r}: the first turn must be from human")
    if not user:
        raise RowError("no human turn in 'conversations'")
    return _optional_str(row, "id", ""), "conversation", tuple(prefix), tuple(user), None


def _messages(row: dict, default_id: str, stem: str) -> tuple:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise RowError("'messages' must be a non-empty list of {role, content}")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise RowError(f"messages[{i}] must be {{role: system|user|assistant, content: str}}, got {m!r:.80}")
        clean.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
    if clean[-1]["role"] != "user":
        raise RowError(f"the last message must have role 'user' (it is the live request), got {clean[-1]['role']!r}")
    ident, category = _optional_str(row, "id", default_id), _optional_str(row, "category", stem)
    return ident, category, tuple(clean[:-1]), (clean[-1]["content"],), None


def _prompt(row: dict, default_id: str, stem: str) -> tuple:
    text = _text(row["prompt"], "'prompt'")
    return _optional_str(row, "id", default_id), _optional_str(row, "category", stem), (), (), text


PARSERS = {"specbench": _specbench, "sharegpt": _sharegpt, "messages": _messages, "prompt": _prompt}


def to_conversation(row: Row, fmt: str, stem: str, max_turns: int | None = None) -> Conversation:
    """One row in format `fmt` -> a Conversation, or RowError."""
    value = row.value
    missing = [k for k in FORMAT_KEYS[fmt] if not isinstance(value, dict) or k not in value]
    if missing:
        raise RowError(f"{_shape(value)}; format {fmt} needs {', '.join(FORMAT_KEYS[fmt])} (missing "
                       f"{', '.join(missing)}); a file holds one format")
    ident, category, prefix, user, raw = PARSERS[fmt](value, f"{stem}-{row.source.rsplit(':', 1)[1]}", stem)
    if not ident:
        raise RowError(f"'{FORMAT_KEYS[fmt][0]}' is empty")
    if max_turns is not None:
        user = user[:max_turns]
    return Conversation(ident, category, prefix, user, raw, row.source)


def parse_rows(rows: Iterable[Row], fmt: str, stem: str, max_turns: int | None = None, skip_invalid: bool = False,
               name: str | None = None) -> tuple[list[Conversation], list[str]]:
    """All rows -> (conversations, problems). Refuses the whole set on any problem unless `skip_invalid`,
    which drops bad rows and later duplicates (for big real datasets with imperfect rows)."""
    convs, problems, seen = [], [], {}
    for row in rows:
        try:
            conv = to_conversation(row, fmt, stem, max_turns)
        except RowError as err:
            problems.append(f"{row.where}: {err}")
            continue
        if conv.id in seen:
            problems.append(f"{row.where}: duplicate id {conv.id!r} (first at {seen[conv.id]}); ids must be unique")
            continue
        seen[conv.id] = row.where
        convs.append(conv)
    if problems and not skip_invalid:
        raise refuse(f"{name or stem} (format {fmt})", problems)
    return convs, problems


def check_format(fmt: str, max_turns: int | None) -> None:
    if fmt != "auto" and fmt not in FORMATS:
        raise WorkloadError(f"unknown prompt format {fmt!r}; use auto or one of {list(FORMATS)}")
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise WorkloadError(f"max_turns must be a positive integer or null, got {max_turns!r}")


def load_file(path: Path, fmt: str = "auto", max_turns: int | None = None) -> list[Conversation]:
    """A whole prompt file, or WorkloadError listing every problem."""
    check_format(fmt, max_turns)
    rows = read_rows(path)
    if not rows:
        raise WorkloadError(f"{path}: the prompt file is empty; it needs at least one row")
    if fmt == "auto":
        fmt = detect_format(rows[0])
    return parse_rows(rows, fmt, path.stem, max_turns, name=str(path))[0]
