"""Text the package prints that came from a user's values (a shared leaf: it imports nothing of the package).

- **Commands** (:func:`shell_join`, :func:`shell_quote`): a printed command line is one a user may paste into
  bash, so it must run exactly the argv it stands for. A word with no control character is quoted as
  ``shlex.quote`` does; one with a control character (C0, DEL, C1) or any other character that does not print
  (a bidi override, a line separator, a lone surrogate) is written in bash's ``$'...'`` form, each such
  character as the ``\\xHH`` escapes of its UTF-8 bytes (the raw byte, for one Python decoded with
  ``surrogateescape``): pasted, it gives the very same bytes, and printed, it cannot recolour, retitle or clear
  the terminal.
- **Tables and messages** (:func:`escape_controls`): every character that does not print is shown as its
  escape (``\\x1b``, ``\\r``, ``\\u202e``), never written raw.
"""

from __future__ import annotations

import re

#: Words ``shlex.quote`` leaves as they are.
_SAFE_WORD = re.compile(r"[\w@%+=:,./-]+", re.ASCII)
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _utf8(ch: str) -> bytes:
    """The bytes ``ch`` stands for in an argv (a lone surrogate of ``surrogateescape``: its raw byte)."""
    try:
        return ch.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no argv can hold; shown all the same
        return ch.encode("utf-8", "surrogatepass")


def _ansi_c(ch: str) -> str:
    """``ch`` inside bash's ``$'...'``."""
    if ch in ("\\", "'"):
        return "\\" + ch
    if ch.isprintable():
        return ch
    return _NAMED.get(ch) or "".join(f"\\x{byte:02x}" for byte in _utf8(ch))


def shell_quote(word: str) -> str:
    """``word`` as bash reads it back exactly: as it is, in ``'...'``, or in ``$'...'`` where it holds a
    character that does not print."""
    if _SAFE_WORD.fullmatch(word):
        return word
    if word.isprintable():
        return "'" + word.replace("'", "'\"'\"'") + "'"
    return "$'" + "".join(_ansi_c(ch) for ch in word) + "'"


def shell_join(argv: list[str] | tuple[str, ...]) -> str:
    """The command line of ``argv`` that bash runs as exactly ``argv``."""
    return " ".join(shell_quote(word) for word in argv)


def _escaped(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every character that does not print (but the space, and newlines where
    ``keep_newlines``) written as its escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or (keep_newlines and ch == "\n") else _escaped(ch) for ch in text)


__all__ = ["escape_controls", "shell_join", "shell_quote"]
