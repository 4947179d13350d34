"""User-facing configuration errors.

Every check in this package reports into a :class:`ProblemCollector`, so that a user sees *all* problems of a
deployment in one message, before anything starts. Each problem names the config key, the offending value and
what would be valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a deployment: where (a config key path) and what."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class DeploymentConfigError(ValueError):
    """A deployment description that cannot be resolved. Carries every problem found, not just the first."""

    def __init__(self, problems: Iterable[Problem], *, source: str = "") -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.problems)
        where = f" in {self.source}" if self.source else ""
        head = f"{count} problem{'s' if count != 1 else ''} with the SGLang deployment{where}:"
        return "\n".join([head, *(f"  - {problem}" for problem in self.problems)])


class ProblemCollector:
    """Accumulates problems; :meth:`raise_if_any` turns them into one :class:`DeploymentConfigError`."""

    def __init__(self, source: str = "") -> None:
        self.source = source
        self.problems: list[Problem] = []

    def add(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))

    def extend(self, problems: Iterable[Problem]) -> None:
        self.problems.extend(problems)

    def __bool__(self) -> bool:
        return bool(self.problems)

    def raise_if_any(self) -> None:
        if self.problems:
            raise DeploymentConfigError(self.problems, source=self.source)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (the rest is usually a traceback-like context dump)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
