"""The ledger's clock, and timestamps as it stores them: ISO-8601 UTC text that sqlite3 shows readably."""
from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def iso_utc(value: datetime) -> str:
    """An aware datetime as the ledger stores it: ISO-8601 UTC text to the millisecond (`…T04:57:12.123Z`)."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def parse_utc(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text.replace("Z", "+00:00"))
