"""Issue 35's GPU check, rehearsed end to end on the REAL trainer's CPU rig (LW_RIG_DIR, ../shared/rig), so that the
first GPU minute is not its first run: `python -m bench.gpu_check --cpu` builds its random SDXL checkpoint (on the
CPU), starts the worker as gunicorn with the shipped config, reads the start-up deep health check, and runs two jobs
through the detached supervisor, the sandbox and sd-scripts: 3 steps at 256 px, then the same with a sample pass at
the start and at the save of step 2 (the request's one prompt at 256 px, 2 sampler steps). What a CPU cannot measure
(VRAM, NVML, nvidia-smi) must be a row saying why.

Opt-in: run alone, `flock /tmp/lw-rig.lock`, with >= 21 GB free; about 15 min on a quiet 2-core machine, 30 or more
beside other work (the checkpoint build, two model loads, bf16 steps on the CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.gpu_check.clip_vocab import write_folders
from lora_worker.config import REPO_ROOT
from lora_worker.host import sandbox

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(3600)]

RIG = os.environ.get("LW_RIG_DIR")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory):
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    rig, work = Path(RIG), tmp_path_factory.mktemp("gpucheck")
    out = work / "out"
    bwrap = sandbox.bwrap_executable()
    argv = [sys.executable, "-m", "bench.gpu_check", "--cpu", "--trainer-venv", str(rig / "venv"),
            "--sd-scripts", str(rig / "sd-scripts"), "--tokenizers", str(rig / "tokenizers"), "--work", str(work),
            "--out", str(out), *(["--bwrap", bwrap] if bwrap else ["--sandbox-none", "no bwrap on this machine"])]
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LW_GPU_CHECK_T0")}
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=3300, check=False)
    finally:
        for model in (work / "models").glob("*.safetensors"):
            model.unlink()  # 6.94 GB: pytest keeps its last temporary directories
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    doc = json.loads((out / "gpu-check.json").read_text())
    return done, doc, {(r["section"], r["measure"]): r for r in doc["rows"]}, out


def test_the_check_runs_to_its_end_and_writes_its_table_json_and_logs(rehearsal) -> None:
    done, doc, rows, out = rehearsal
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "gpu-check.md").read_text()
    assert table in done.stdout and "| section | measure | value | how |" in table
    assert doc["mode"] == "cpu rehearsal" and doc["trainer"]["transformers"] == "4.54.1"
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        names = tar.getnames()
    assert "make_sdxl.log" in names and sum(n.startswith("job-") for n in names) == 2
    assert sum(n.startswith("gunicorn-") for n in names) == 2  # one service per run, as `make run` starts it


def test_its_checkpoint_is_built_on_the_cpu_and_sd_scripts_loads_it_whole(rehearsal) -> None:
    _, _, rows, _ = rehearsal
    assert rows[("checkpoint", "random SDXL built on cpu")]["value"] > 0
    assert "6.94 GB" in rows[("checkpoint", "random SDXL built on cpu")]["how"]
    assert rows[("checkpoint", "sd-scripts loaded it")]["ok"] is True


def test_the_deep_health_check_runs_the_sandbox_and_the_trainers_interpreter(rehearsal) -> None:
    _, _, rows, _ = rehearsal
    deep = {measure: r for (section, measure), r in rows.items() if section == "deep health"}
    assert deep["sandbox"]["ok"] is True
    # On a CPU the trainer's torch sees no CUDA: the check says so, as it will say the opposite on a GPU.
    assert deep["trainer in the sandbox"]["ok"] is False
    assert "sees no CUDA device" in deep["trainer in the sandbox"]["value"]


@pytest.mark.parametrize("run", ["run 256 px", "run 256 px + sample"])
def test_each_run_trains_through_the_worker_and_is_measured(rehearsal, run: str) -> None:
    _, _, rows, _ = rehearsal
    assert rows[(run, "job")]["ok"] is True, rows[(run, "job")]
    for measure in ("seconds per step", "  as the worker measured it", "training phase per step"):
        assert rows[(run, measure)]["value"] > 0, measure
    assert rows[(run, "pre-training phase")]["value"] > rows[(run, "  loading_model")]["value"] > 0
    assert 0 < rows[(run, "worker's CPU share")]["value"] < 50
    assert rows[(run, "peak VRAM")]["value"] is None and "--cpu" in rows[(run, "peak VRAM")]["why"]


def test_the_sample_run_times_each_pass_from_its_log_line_to_its_image(rehearsal) -> None:
    _, _, rows, _ = rehearsal
    passes = {m: r for (s, m), r in rows.items() if s == "run 256 px + sample" and m.startswith("sample pass")}
    assert sorted(passes) == [f"sample pass at step {n} (256 px, 2 sampler steps)" for n in (0, 2)]
    assert all(r["value"] > 0 for r in passes.values()), passes
    assert not [m for (s, m) in rows if s == "run 256 px" and m.startswith("sample pass")]


def test_what_a_cpu_cannot_measure_is_a_row_saying_why(rehearsal) -> None:
    _, doc, rows, _ = rehearsal
    assert rows[("card", "GPU")]["why"] == "--cpu: the CPU rig has no GPU"
    assert "NVML is not available" in rows[("nvml vs nvidia-smi", "NVML through the worker's binding")]["why"]
    assert all(r["why"] for r in doc["rows"] if r["value"] is None)


def test_the_bundles_tokenizers_are_the_rigs_byte_for_byte(tmp_path: Path) -> None:
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    rig = Path(RIG)
    write_folders(rig / "rig" / "assets" / "bpe_simple_vocab_16e6.txt.gz", tmp_path)
    for folder in (rig / "tokenizers").iterdir():
        for path in folder.iterdir():
            assert (tmp_path / folder.name / path.name).read_bytes() == path.read_bytes(), path
