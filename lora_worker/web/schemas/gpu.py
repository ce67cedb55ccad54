"""The shapes of GET /gpu and GET /healthz."""
from __future__ import annotations

from marshmallow import Schema, fields


class GpuProcessSchema(Schema):
    pid = fields.Integer()
    name = fields.String(allow_none=True)
    used_mib = fields.Integer(allow_none=True)
    ours = fields.Boolean()
    tts = fields.Boolean()


class GpuLockSchema(Schema):
    """The device's host-wide interlock (`<gpu_lock_dir>/gpu-<index>.lock`)."""

    held = fields.Boolean(metadata={"description": "some trainer holds the lock: a POST for this device is a 409 "
                                                   "`gpu_locked` unless it is ours"})
    holder_pid = fields.Integer(allow_none=True, metadata={
        "description": "the pid that took the lock (/proc/locks); null when free or not visible"})
    holder_name = fields.String(allow_none=True)
    ours = fields.Boolean(metadata={"description": "the holder is the active job's supervisor"})


class GpuDeviceSchema(Schema):
    index = fields.Integer()
    label = fields.String(allow_none=True)
    allowed_tiers = fields.List(fields.String())
    name = fields.String(allow_none=True)
    uuid = fields.String(allow_none=True)
    pci_bus_id = fields.String(allow_none=True)
    memory_total_mib = fields.Integer(allow_none=True)
    memory_used_mib = fields.Integer(allow_none=True)
    memory_free_mib = fields.Integer(allow_none=True)
    utilization_pct = fields.Integer(allow_none=True)
    temperature_c = fields.Integer(allow_none=True)
    processes = fields.List(fields.Nested(GpuProcessSchema), allow_none=True, metadata={
        "description": "null when NVML's process query failed: unknown, never empty (POST /train then refuses "
                       "the device with a 503 `nvml_unavailable`)"})
    processes_error = fields.String(allow_none=True, metadata={"description": "why `processes` is null"})
    lock = fields.Nested(GpuLockSchema)
    error = fields.String(allow_none=True)


class GpuStatusSchema(Schema):
    devices = fields.List(fields.Nested(GpuDeviceSchema))
    tts_on_3090 = fields.Boolean(allow_none=True, metadata={
        "description": "null when the TTS device's processes cannot be read: unknown, not false"})
    active_job_id = fields.Integer(allow_none=True)


class HealthSchema(Schema):
    status = fields.String(metadata={"description": "`ok`; when the ledger is not the file the service opened, the "
                                                    "answer is a 503 `ledger_replaced` error instead"})
    ledger = fields.String(metadata={"description": "`ok`, or why the ledger file is not the one opened"})
    active_job_id = fields.Integer(allow_none=True, metadata={
        "description": "the oldest queued or running job (the only one on the local backend)"})
    active_job_ids = fields.List(fields.Integer(), metadata={
        "description": "every queued or running job, oldest first (several under Slurm, max_active_jobs)"})
    nvml = fields.String()
    trainer = fields.String(metadata={"description": "sd-scripts, or simulated: the test double, which trains nothing"})
    sandbox = fields.String(metadata={"description": "the trainer's sandbox in force: `bwrap (<path>)`, `none …`, "
                                                     "or `unavailable: …` (then POST /train is a 503)"})
    deep = fields.Dict(metadata={"description": "with ?deep=1: the deep checks run once at start-up (this host's, "
                                                "or the cluster's under Slurm): `status` ok, failing or pending "
                                                "(then 503), `failed` (names), `unchecked` (names of those that "
                                                "could not be made), `simulated`, `checks` (name, ok, required, "
                                                "simulated, checked, detail), `checked_at`"})
