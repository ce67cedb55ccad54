"""The field kinds and validators the shapes share: whole-match patterns, JSON numbers, values shown only in
some states, and values as in effect."""
from __future__ import annotations

import math
from typing import Any

from marshmallow import ValidationError, fields, missing, validate

from lora_worker.states import ACTIVE_STATES, TERMINAL_STATES, JobState

MAX_PATH = 4096


class FullMatch(validate.Regexp):
    """A Regexp validator that must match the whole value (re.fullmatch), documented by its pattern."""

    def __call__(self, value: str) -> str:  # type: ignore[override]  # a request's values are text, never bytes
        if self.regex.fullmatch(value) is None:  # type: ignore[call-overload]  # a str pattern (above)
            raise ValidationError(self._format_error(value))
        return value


def path_field() -> fields.String:
    return fields.String(required=True, validate=validate.Length(min=1, max=MAX_PATH))


class JsonNumber(fields.Float):
    """A JSON number and nothing else: marshmallow's Float would take "0.5" or true, which the OpenAPI
    document (type: number) and the strict integer fields refuse."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class FiniteFloat(fields.Float):
    """A float that goes out as null when it is nan or infinite: JSON has no such numbers."""

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> float | None:
        if value is None or not math.isfinite(value):
            return None
        return super()._serialize(value, attr, obj, **kwargs)  # type: ignore[return-value]  # no as_string here


class InStates:
    """A field shown only while the job is in one of `states`; null otherwise, whatever the row holds."""

    states: frozenset[JobState]

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> Any:
        if JobState(obj.status) not in self.states:
            return None
        return super()._serialize(value, attr, obj, **kwargs)  # type: ignore[misc]


class WhileActive(InStates, fields.Float):
    """The time left: a queued or running job's only. Null on a finished job, even in a row written before
    terminal writes cleared it."""

    states = ACTIVE_STATES


class WhileActiveString(InStates, fields.String):
    """What a `WhileActive` number rests on: null on a finished job, like the number."""

    states = ACTIVE_STATES


class EndedInPhase(InStates, fields.String):
    """The phase a finished job was in when it ended; null while it is active."""

    states = TERMINAL_STATES


class InEffect(fields.Field[Any]):
    """An optional request value as it took effect: the recipe's default where the request left it out."""

    def __init__(self, inner: fields.Field[Any], default: object, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner, self.default = inner, default

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> Any:
        return self.inner._serialize(self.default if value is None else value, attr, obj, **kwargs)


class SameObject(fields.Nested):
    """A nested object read from the object being dumped itself: a group of its columns under one key."""

    def get_value(self, obj: Any, attr: str, accessor: Any = None, default: Any = missing) -> Any:
        return obj
