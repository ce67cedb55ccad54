"""What /metrics serves, read from `job_counts`: aggregates the ledger's triggers keep (migration 0008), so a
scrape is constant work however long the history. Read through `repository.counts`."""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from lora_worker.ledger.db import Database
from lora_worker.ledger.models import JobCount


@dataclass(frozen=True)
class Counts:
    """What /metrics serves, read from `job_counts` (kept by triggers; migration 0008): constant work per
    scrape, however long the history."""

    by_status: dict[str, int]
    failures_by_class: dict[str, int]
    # status -> ([(upper bound in seconds, jobs in that bucket alone)], jobs, seconds in all); +Inf last
    durations: dict[str, tuple[list[tuple[float, int]], int, float]]
    reconcile_actions: dict[tuple[str, str], int]  # (actor, failure class) -> jobs
    webhook_events: dict[str, int]  # pending | retrying | delivered | given_up -> events (migration 0012)


def counts(db: Database) -> Counts:
    with db.read() as s:
        rows = [(metric, label, n) for metric, label, n in s.execute(select(JobCount.metric, JobCount.label,
                                                                            JobCount.n)) if n]
    return Counts(
        by_status={label: int(n) for metric, label, n in rows if metric == "status"},
        failures_by_class={label: int(n) for metric, label, n in rows if metric == "failure"},
        durations=_durations(rows),
        reconcile_actions={tuple(label.split("|", 1)): int(n)  # type: ignore[misc]
                           for metric, label, n in rows if metric == "reconcile"},
        webhook_events={label: int(n) for metric, label, n in rows if metric == "webhook"},
    )


def _durations(rows: list[tuple[str, str, float]]) -> dict[str, tuple[list[tuple[float, int]], int, float]]:
    """The duration histogram by status: its buckets (`<status>|<bound>`), their total, and the seconds' sum."""
    buckets: dict[str, list[tuple[float, int]]] = {}
    sums: dict[str, float] = {}
    for metric, label, n in rows:
        if metric == "duration_bucket":
            status, bound = label.rsplit("|", 1)
            buckets.setdefault(status, []).append((float(bound), int(n)))
        elif metric == "duration_sum":
            sums[label] = n
    return {status: (sorted(pairs), sum(c for _, c in pairs), sums.get(status, 0.0))
            for status, pairs in buckets.items()}
