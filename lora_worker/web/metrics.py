"""GET /metrics: Prometheus text, computed from the ledger and NVML at scrape time.

The supervisor is another process, so in-process counters would miss what it does: every number here is read
from the ledger (or NVML) when Prometheus asks, by one collector on a registry of this app's own. Counts cover
the jobs the ledger still holds, so `lora-worker jobs prune` lowers them; they are gauges, not counters.
"""
from __future__ import annotations

from collections.abc import Iterator

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from lora_worker.web import worker
from lora_worker.errors import NvmlUnavailable
from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass, JobState, Phase
from lora_worker.web.service import Worker

bp = Blueprint("metrics", __name__)

MIB = 1024 * 1024
# Seconds: the fast tier takes minutes, quality on the small card a few hours. The ledger's triggers count
# finished jobs into these same buckets (migration 0008 writes them out; a test holds the two equal).
DURATION_BUCKETS = (60.0, 300.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0, 10800.0, 14400.0)


class LedgerCollector:
    """Reads the ledger and NVML on every scrape; holds no state of its own."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        counts = repo.counts(self.worker.db)  # aggregates kept by the ledger's triggers: no history scan
        yield _by_label("lora_worker_jobs", "Jobs in the ledger by status.", "status",
                        [s.value for s in JobState], counts.by_status)
        yield _by_label("lora_worker_job_failures", "Failed jobs in the ledger by failure class.", "failure_class",
                        [f.value for f in FailureClass], counts.failures_by_class)
        yield _durations(counts.durations)
        yield _reconcile_actions(counts.reconcile_actions)
        yield _by_label("lora_worker_webhook_events", "Webhook events in the outbox by delivery state (retrying: "
                        "tried and due again; given_up: 410 Gone or past webhook_give_up_s).", "state",
                        ["pending", "retrying", "delivered", "given_up"], counts.webhook_events)
        queued = GaugeMetricFamily("lora_worker_queue_depth",
                                   "Jobs accepted and waiting to start (on Slurm: waiting for a GPU).")
        queued.add_metric([], counts.by_status.get(JobState.QUEUED.value, 0))
        yield queued
        yield from _active_job(self.worker)
        yield from _gpu_memory(self.worker)


def registry_for(worker: Worker) -> CollectorRegistry:
    # auto_describe=False: registering must not read the ledger; the first scrape does.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(worker))
    return registry


@bp.get("/metrics")
def metrics() -> Response:
    worker().reconcile_active()  # a dead supervisor must not show as a running phase
    body = generate_latest(current_app.extensions["lora_worker_metrics"])
    return Response(body, mimetype=None, content_type=CONTENT_TYPE_LATEST)


def _by_label(name: str, doc: str, label: str, known: list[str], counts: dict[str, int]) -> GaugeMetricFamily:
    # Every known value is exported, zeros included, so a query never sees a series appear from nothing.
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value in sorted(set(known) | set(counts)):
        family.add_metric([value], counts.get(value, 0))
    return family


def _durations(durations: dict[str, tuple[list[tuple[float, int]], int, float]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily("lora_worker_job_duration_seconds",
                                   "Wall time of finished jobs in the ledger, start to end, by final status.",
                                   labels=["status"])
    for status, (buckets, count, seconds) in sorted(durations.items()):
        alone = dict(buckets)  # jobs in each bucket by itself; Prometheus wants them cumulative, every bound
        cumulative, running = [], 0
        for bound in DURATION_BUCKETS:
            running += alone.get(bound, 0)
            cumulative.append((floatToGoString(bound), running))
        family.add_metric([status], [*cumulative, ("+Inf", count)], seconds)
    return family


def _reconcile_actions(actions: dict[tuple[str, str], int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily("lora_worker_reconcile_actions",
                               "Jobs marked failed because their supervisor was gone, by who noticed and why.",
                               labels=["actor", "failure_class"])
    for (actor, failure), count in sorted(actions.items()):
        family.add_metric([actor, failure], count)
    return family


def _active_job(w: Worker) -> Iterator[Metric]:
    job = repo.active_job(w.db)
    active = GaugeMetricFamily("lora_worker_active_jobs",
                               "Jobs queued or running (0 or 1 locally; on Slurm, 1 while any is).")
    active.add_metric([], 0 if job is None else 1)
    yield active
    phase = GaugeMetricFamily("lora_worker_active_job_phase", "1 for the phase the active job is in.",
                              labels=["phase"])
    for p in Phase:
        phase.add_metric([p.value], 1 if job is not None and job.phase == p.value else 0)
    yield phase
    rate = GaugeMetricFamily("lora_worker_active_job_step_rate",
                             "Optimizer steps per second of the active job, measured by its supervisor "
                             "(warm-up left out), or as the trainer reports it before that.")
    step = GaugeMetricFamily("lora_worker_active_job_step", "Optimizer steps the active job has done.")
    total = GaugeMetricFamily("lora_worker_active_job_total_steps", "Optimizer steps the active job will do.")
    if job is not None:
        step.add_metric([], job.step)
        total.add_metric([], job.total_steps)
        if job.rate is not None:
            rate.add_metric([], job.rate)
    yield from (rate, step, total)


def _gpu_memory(w: Worker) -> Iterator[Metric]:
    up = GaugeMetricFamily("lora_worker_nvml_up", "1 when NVML answered this scrape.")
    used = GaugeMetricFamily("lora_worker_gpu_memory_used_bytes", "GPU memory in use, per device (PCI bus order).",
                             labels=["device", "name"])
    total = GaugeMetricFamily("lora_worker_gpu_memory_total_bytes", "GPU memory, per device (PCI bus order).",
                              labels=["device", "name"])
    try:
        readings = w.nvml.read()
    except NvmlUnavailable:
        readings = None
    up.add_metric([], 0 if readings is None else 1)
    for reading in readings or []:
        labels = [str(reading.index), reading.name or ""]
        if reading.memory_used_mib is not None:
            used.add_metric(labels, reading.memory_used_mib * MIB)
        if reading.memory_total_mib is not None:
            total.add_metric(labels, reading.memory_total_mib * MIB)
    yield from (up, used, total)
