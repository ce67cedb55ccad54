"""Issue #38, second case: a deeply nested safetensors header made json.loads raise RecursionError out of the
header parser. As the base model, POST /train answered 500 internal_error (a header whose length lies was a clean
422); as a step LoRA, the checkpoint's verification raised inside the supervisor's loop. Now the header is refused,
HeaderError, like any other malformed one: a 422 before anything is written, a step LoRA recorded unverified with
the cause while the job goes on."""
from __future__ import annotations

import sqlite3
import struct
from pathlib import Path

import pytest

from lora_worker.host import safetensors
from lora_worker.host.safetensors import ExpectedLora, verify_lora
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.parser import Parser
from tests.helpers import job_rows, wait_for
from tests.helpers.checkpoints import WatchedJob
from tests.helpers.runs import TERMINAL, modes, submit, wait_state

NESTED = b"[" * 100_000


def nested(path: Path) -> Path:
    """A safetensors file whose header is arrays nested 100,000 deep (its length tells no lie)."""
    path.write_bytes(struct.pack("<Q", len(NESTED)) + NESTED)
    return path


def test_a_nested_base_model_header_is_a_422_before_anything_is_written(api, host, launches):
    nested(host.model)
    response = api.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 422 and body["error"] == "base_model_invalid", body  # 500 before
    assert "not JSON (RecursionError" in body["fields"]["base_model_path"][0]
    assert job_rows(host.settings) == 0 and launches == []


def test_a_nested_step_lora_is_recorded_unverified_with_the_cause(tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    nested(out / "ohwx-step00000002.safetensors")
    watcher = Checkpoints(WatchedJob(str(out)))
    parser = Parser()
    parser.feed(f"\nsaving checkpoint: {out}/ohwx-step00000002.safetensors\n"
                "\rsteps:  33%|███       | 3/9 [00:01<00:02,  3.90it/s, avr_loss=0.5]")
    [row] = watcher.take(parser.progress, ended=False)  # raised RecursionError before: the supervisor's loop died
    assert (row.kind, row.step, row.verified, row.sha256) == ("lora", 2, False, None)
    assert "not JSON (RecursionError" in (row.error or "")


def test_whatever_the_check_meets_a_lora_is_an_artifact_check_with_the_cause(tmp_path, monkeypatch, caplog):
    """The net under the parser: an error nobody foresaw is the file's problem, logged with its traceback."""
    def broken(fh, name):
        raise MemoryError("a header the check could not hold")
    monkeypatch.setattr(safetensors, "parse_header", broken)
    path = nested(tmp_path / "ohwx.safetensors")
    check = verify_lora(path, ExpectedLora(rank=4, output_name="ohwx", steps=9, seed=42, dtype="F16"))
    assert check.problem == "ohwx.safetensors could not be checked (MemoryError: a header the check could not hold)"
    assert check.sha256 is None and [r.exc_info is not None for r in caplog.records] == [True]


@pytest.mark.slow
def test_a_run_whose_step_lora_is_replaced_by_a_nested_header_succeeds_with_it_unverified(client, host):
    """Through the real supervisor: the trainer holds right after its step-100 save (before the redraw that makes
    the supervisor verify it), the file is overwritten in place, and the run goes on to a verified LoRA."""
    release = host.root / "release"
    modes(host, hold_at_step=101, release_file=str(release))
    job_id = submit(client, host)
    step_lora = host.dataset.parent / "output" / "ohwx_lora-step00000100.safetensors"
    wait_for(step_lora.exists, what="the step-100 LoRA")
    with step_lora.open("r+b") as fh:  # in place: the same file, one link, as a flipped disk or a hostile peer
        fh.write(struct.pack("<Q", len(NESTED)) + NESTED)
        fh.truncate()
    release.touch()
    done = wait_state(client, job_id, *TERMINAL, timeout=60)
    assert (done["status"], done["failure_class"]) == ("succeeded", None), done  # supervisor_lost before
    rows = [c for c in checkpoint_rows(host, job_id) if c[1] == 100 and c[0] == "lora"]
    assert rows and rows[0][2] == 0 and "not JSON (RecursionError" in rows[0][3]


def checkpoint_rows(host, job_id: int) -> list[tuple]:
    conn = sqlite3.connect(host.settings.database_path)
    try:
        return conn.execute("SELECT kind, step, verified, error FROM checkpoints WHERE job_id = ?",
                            (job_id,)).fetchall()
    finally:
        conn.close()
