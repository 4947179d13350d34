"""Reading a ``--sglang-config`` file within bounds: what the file can make this process read, parse and build.

A Miles/slime config is a few KB with a few hundred YAML nodes. The limits below are far above that and keep
the worst case to about a second of parsing (PyYAML's pure-Python loader, which the strict duplicate-key
check needs): a bigger file, a device (``/dev/zero``), a pipe that never ends, deep nesting (``[[[[…``), and
aliases that expand exponentially ("billion laughs") are each refused with a message that states the limit.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import time
from pathlib import Path
from typing import Any

import yaml

from miles_sglang_plugin.errors import ProblemCollector

#: The largest file (or ``base64:`` payload, decoded) read: 256 KiB.
MAX_CONFIG_BYTES = 256 * 1024
#: The deepest nesting of mappings and lists.
MAX_YAML_DEPTH = 64
#: The most YAML nodes (keys, values, list items), counting every expansion of an alias.
MAX_YAML_NODES = 20_000
#: How long a pipe (``<(...)``, ``/dev/stdin``) may take to deliver the whole file.
PIPE_READ_TIMEOUT_S = 30.0

_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class ConfigSourceError(ValueError):
    """The source cannot be read as a config file (not a file, too big, too slow); ``str()`` says why."""


def too_big_message() -> str:
    return (
        f"is larger than {MAX_CONFIG_BYTES // 1024} KiB, the most a --sglang-config file may hold here (a Miles "
        "config is a few KB)"
    )


def _read_pipe(fd: int) -> bytes:
    """A pipe's bytes until EOF, at most ``MAX_CONFIG_BYTES`` + 1, within ``PIPE_READ_TIMEOUT_S``."""
    os.set_blocking(fd, False)
    deadline = time.monotonic() + PIPE_READ_TIMEOUT_S
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_CONFIG_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ConfigSourceError(
                f"is a pipe that did not deliver the whole file within {PIPE_READ_TIMEOUT_S:g} s"
            )
        with contextlib.suppress(BlockingIOError):
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)


def read_bytes_bounded(path: Path) -> bytes:
    """The bytes of ``path``, a regular file or a pipe, refusing anything else and anything too big.
    Raises ``OSError`` (missing, unreadable) or :class:`ConfigSourceError`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO without writer
    try:
        mode = os.fstat(fd).st_mode
        kind = stat.S_IFMT(mode)
        if kind in _KINDS:
            raise ConfigSourceError(f"is {_KINDS[kind]}, not a YAML file")
        if stat.S_ISFIFO(mode):
            data = _read_pipe(fd)
        else:
            os.set_blocking(fd, True)
            data = b""
            while len(data) <= MAX_CONFIG_BYTES and (chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))):
                data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigSourceError(too_big_message())
    return data


class _LimitError(yaml.MarkedYAMLError):
    """A bound of this module was passed (reported like a syntax error, at its line and column)."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes under ``node``, itself included, every alias counted in full (memoised: linear in the file)."""
    key = id(node)
    if key not in sizes:
        if isinstance(node, yaml.SequenceNode):
            sizes[key] = 1 + sum(_expanded_size(item, sizes) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            sizes[key] = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
        else:
            sizes[key] = 1
    return sizes[key]


def _start_mark(event: yaml.Event) -> yaml.Mark | None:
    """Where ``event`` starts: a ``yaml.Mark`` from this pure-Python loader (types-PyYAML's type of an event's
    mark also allows the C parser's)."""
    mark = event.start_mark
    return mark if isinstance(mark, yaml.Mark) else None


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` within this module's bounds, which also records duplicate mapping keys (PyYAML
    silently keeps the last one)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[str, int, int]] = []
        self._depth = 0
        self._nodes = 0
        self._open_anchors: list[str | None] = []
        self._sizes: dict[int, int] = {}

    def _count(self, nodes: int, mark: yaml.Mark | None) -> None:
        self._nodes += nodes
        if self._nodes > MAX_YAML_NODES:
            raise _LimitError(
                problem=f"more than {MAX_YAML_NODES:,} YAML nodes (aliases counted in full), the most a "
                "--sglang-config file may hold here",
                problem_mark=mark,
            )

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # unannotated in types-PyYAML
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise _LimitError(
                    problem=f"alias *{event.anchor} refers to a node that contains it",
                    problem_mark=_start_mark(event),
                )
            node = super().compose_node(parent, index)
            if node is not None:  # PyYAML returns the anchored node (types-PyYAML allows None)
                self._count(_expanded_size(node, self._sizes), _start_mark(event))
            return node
        if self._depth >= MAX_YAML_DEPTH:
            raise _LimitError(
                problem=f"nested deeper than {MAX_YAML_DEPTH} levels, the most a --sglang-config file may nest",
                problem_mark=_start_mark(event),
            )
        self._count(1, _start_mark(event))
        self._depth += 1
        self._open_anchors.append(getattr(event, "anchor", None))
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.pop()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                self.duplicates.append((str(key), mark.line + 1, mark.column + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _reader_problem(exc: yaml.reader.ReaderError, text: str, label: str, problems: ProblemCollector) -> None:
    """A character YAML does not allow (a NUL byte, a control character), at its line and column."""
    before = text[: exc.position]
    line, column = before.count("\n") + 1, exc.position - (before.rfind("\n") + 1) + 1
    character = exc.character if isinstance(exc.character, str) else chr(exc.character)
    problems.add(
        f"{label}: line {line}, column {column}",
        f"the character U+{ord(character):04X} is not allowed in YAML (a binary file?)",
    )


def parse_yaml(text: str, label: str, problems: ProblemCollector) -> tuple[bool, Any]:
    """(whether ``text`` parsed, its data); what is wrong goes into ``problems`` under ``label``."""
    try:
        loader = StrictSafeLoader(text)  # the reader checks every character here already
    except yaml.reader.ReaderError as exc:
        _reader_problem(exc, text, label, problems)
        return False, None
    try:
        data = loader.get_single_data()
    except yaml.reader.ReaderError as exc:
        _reader_problem(exc, text, label, problems)
        return False, None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{label}: line {mark.line + 1}, column {mark.column + 1}" if mark else label
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        problems.add(where, f"YAML syntax error: {what or exc}" if not isinstance(exc, _LimitError) else what)
        return False, None
    except yaml.YAMLError as exc:
        problems.add(label, f"YAML error: {exc}")
        return False, None
    finally:
        loader.dispose()
    for key, line, column in loader.duplicates:
        problems.add(
            f"{label}: line {line}, column {column}",
            f"duplicate key {key!r}; YAML would silently keep only the last one. Give it once",
        )
    return True, data


__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "ConfigSourceError",
    "StrictSafeLoader",
    "parse_yaml",
    "read_bytes_bounded",
]
