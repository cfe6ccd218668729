"""`Choice`: the base of every choice-valued setting (disagg/settings/choices.py) and wire vocabulary: a str enum
whose members are their strings (equal to them, hashed like them, printed and encoded as them), so a setting's
user-facing spelling is its value while the code dispatches on the member."""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A str enum that prints as its value (enum.StrEnum is 3.11+; the project supports 3.10)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)
