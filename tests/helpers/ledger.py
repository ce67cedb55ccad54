"""Ledger rows for tests: the columns of a valid job, and a row as an old schema holds it."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

def old_row(path: Path, status: str) -> int:
    """A row as a 0008 ledger holds it (the ORM already knows the new columns)."""
    cols = {**columns(), "status": status, "created_at": "2026-12-01T10:00:00.000Z",
            "updated_at": "2026-12-01T10:00:00.000Z", "finished_at": "2026-12-01T10:01:00.000Z", "step": 0,
            "version": 1}
    cols["argv"], cols["env"] = json.dumps(cols["argv"]), json.dumps(cols["env"])
    conn = sqlite3.connect(path)
    try:
        with conn:
            names = ", ".join(f'"{c}"' for c in cols)
            cur = conn.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(cols))})",
                               tuple(cols.values()))
        return int(cur.lastrowid)
    finally:
        conn.close()


def columns(**overrides: object) -> dict:
    cols = {
        "train_id": "t1", "dataset_dir": "/train/t1/dataset", "base_model_path": "/models/m.safetensors",
        "output_dir": "/train/t1/output", "output_name": "ohwx", "trigger": "ohwx", "subject_class": "woman",
        "repeats": 10, "tier": "fast", "device_index": 1, "seed": 42, "image_count": 3,
        "argv": ["accelerate", "launch"], "env": {"PATH": "/usr/bin"}, "total_steps": 400,
        "lora_file": "/train/t1/output/ohwx.safetensors", "lora_rank": 16, "lora_steps": 400, "lora_dtype": "F32",
    }
    cols.update(overrides)
    return cols

