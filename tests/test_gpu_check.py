"""The GPU check's own logic (bench/gpu_check), without a GPU or the trainer: the table's rule that a row without a
figure says why, nvidia-smi's CSV and its comparison with the worker's NVML readings, a run's rows from what was
seen, the sample-pass lines, the tokenizer folders, the sd-scripts tarball. The whole check runs on the CPU rig in
tests/rig/test_gpu_check_rehearsal.py."""
from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pytest

from bench.gpu_check import bundle, pins
from bench.gpu_check.nvml_check import SmiApp, SmiGpu, bus_key, compare, parse_apps, parse_gpus
from bench.gpu_check.runs import Outcome, RunSpec, png, rows_of
from bench.gpu_check.table import Row, as_json, failed, number, render, unmeasured
from bench.gpu_check.clip_vocab import FOLDERS, vocabulary, write_folders
from bench.gpu_check.watch import SAMPLE_START, Seen, Watcher
from lora_worker.config import REPO_ROOT, Settings
from lora_worker.dispatch.request import TrainRequest, resolve_request
from lora_worker.dispatch.samples import prompts_file
from lora_worker.host.nvml import GpuProcess, GpuReading
from lora_worker.run.local import LocalBackend

# -- the table ------------------------------------------------------------------------------------------------


def test_a_row_without_a_figure_must_say_why_and_a_measured_one_may_not():
    with pytest.raises(ValueError, match="must say why"):
        Row("run 768 px", "peak VRAM", None)
    with pytest.raises(ValueError, match="no `why`"):
        Row("run 768 px", "peak VRAM", 812, "MiB", why="guessed")
    assert unmeasured("card", "GPU", "--cpu: no GPU").text == "not measured: --cpu: no GPU"


def test_the_table_prints_each_section_once_marks_failures_and_escapes_pipes():
    rows = [Row("nvml vs nvidia-smi", "device 0 uuid", "both GPU-1", ok=True),
            Row("nvml vs nvidia-smi", "device 0 name", "NVML a|b, nvidia-smi c", ok=False),
            Row("run 1024 px", "seconds per step", 0.41234, "s", how="the trainer's bar"),
            unmeasured("run 1024 px", "peak VRAM", "simulated card")]
    table = render("GPU check", rows).splitlines()
    assert table[2] == "| section | measure | value | how |"
    assert table[4] == "| nvml vs nvidia-smi | device 0 uuid | both GPU-1 |  |"
    assert table[5] == "|  | device 0 name | **FAIL** NVML a\\|b, nvidia-smi c |  |"
    assert table[6] == "| run 1024 px | seconds per step | 0.412 s | the trainer's bar |"
    assert table[7] == "|  | peak VRAM | not measured: simulated card |  |"
    assert [r.measure for r in failed(rows)] == ["device 0 name"]
    doc = as_json({"card": "x"}, rows)
    assert doc["card"] == "x" and doc["rows"][3] == {
        "section": "run 1024 px", "measure": "peak VRAM", "value": None, "unit": "", "how": "",
        "why": "simulated card", "ok": None, "text": "not measured: simulated card"}


@pytest.mark.parametrize("value, text", [(0.41234, "0.412"), (12.345, "12.3"), (81559.4, "81559"), (812, "812"),
                                         ("ok", "ok")])
def test_numbers_keep_three_figures_or_so(value, text):
    assert number(value) == text


# -- nvidia-smi and NVML --------------------------------------------------------------------------------------

SMI_GPUS = ("0, 00000000:18:00.0, NVIDIA H100 80GB HBM3, GPU-5e1c, 81559, 1543, 79484, 0, 31, 580.159.04\n"
            "1, 00000000:2A:00.0, NVIDIA H100 80GB HBM3, GPU-77ab, 81559, [N/A], 81080, [Not Supported], 29, "
            "580.159.04\n")
SMI_APPS = "00000000:18:00.0, 4242, 1030\n"


def reading(**changes) -> GpuReading:
    values = dict(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-5e1c", pci_bus_id="00000000:18:00.0",
                  memory_total_mib=81559, memory_used_mib=2074, memory_free_mib=79485, utilization_pct=0,
                  temperature_c=31, processes=(GpuProcess(4242, 1030),))
    return GpuReading(**{**values, **changes})


def test_nvidia_smis_csv_is_read_with_not_available_cells_as_none():
    first, second = parse_gpus(SMI_GPUS)
    assert first == SmiGpu(0, "00000000:18:00.0", "NVIDIA H100 80GB HBM3", "GPU-5e1c", 81559, 1543, 79484, 0, 31,
                           "580.159.04")
    assert (second.bus_id, second.used_mib, second.utilization_pct) == ("00000000:2a:00.0", None, None)
    assert parse_apps(SMI_APPS) == [SmiApp("00000000:18:00.0", 4242, 1030)]
    assert parse_apps("\n") == []


@pytest.mark.parametrize("line", ["0, 00000000:18:00.0, NVIDIA H100", "x, 00000000:18:00.0, a, b, 1, 2, 3, 4, 5, d"])
def test_a_line_nvidia_smi_never_prints_is_refused(line):
    with pytest.raises(ValueError):
        parse_gpus(line)


def test_bus_ids_of_both_spellings_are_one_key():
    assert bus_key("0000:18:00.0") == bus_key("00000000:18:00.0") == "00000000:18:00.0"
    with pytest.raises(ValueError):
        bus_key("18.0")


def test_readings_that_agree_pass_and_used_memory_is_reported_not_judged():
    rows = compare([reading()], parse_gpus(SMI_GPUS)[:1], parse_apps(SMI_APPS))
    by = {r.measure: r for r in rows}
    assert not failed(rows), [r.text for r in failed(rows)]
    assert by["device 0 memory total"].text == "both 81559 MiB"
    assert by["device 0 memory free"].ok  # 79485 against 79484: within the tolerance
    used = by["device 0 memory used"]
    assert used.ok is None and used.text == "NVML 2074 MiB, nvidia-smi 1543 MiB"
    assert by["device 0 compute processes"].text == "NVML [4242], nvidia-smi [4242]"
    assert by["device 0 pid 4242 memory"].text == "both 1030 MiB"


@pytest.mark.parametrize("change, measure", [
    ({"uuid": "GPU-other"}, "device 0 uuid"),
    ({"memory_total_mib": 80000}, "device 0 memory total"),
    ({"memory_free_mib": 70000}, "device 0 memory free"),
    ({"processes": ()}, "device 0 compute processes"),
    ({"processes": (GpuProcess(4242, 512),)}, "device 0 pid 4242 memory"),
    ({"processes": None, "processes_error": "NVMLError_NoPermission"}, "device 0 compute processes"),
    ({"pci_bus_id": "00000000:99:00.0"}, "device 0"),
    ({"error": "NVMLError_GpuIsLost: GPU is lost"}, "device 0"),
])
def test_each_disagreement_is_a_failed_row(change, measure):
    rows = compare([reading(**change)], parse_gpus(SMI_GPUS)[:1], parse_apps(SMI_APPS))
    assert measure in [r.measure for r in failed(rows)], [r.text for r in rows]


def test_a_device_count_that_differs_fails():
    rows = compare([reading()], parse_gpus(SMI_GPUS), parse_apps(SMI_APPS))
    assert [r.text for r in failed(rows)] == ["**FAIL** NVML 1, nvidia-smi 2"]


# -- a run's rows ---------------------------------------------------------------------------------------------

SAMPLED = RunSpec("1024 px + sample", "quality", 1024, 32, 40, 20, sampled=True, sample_steps=20)


def outcome(tmp_path: Path, **job) -> Outcome:
    seen = Seen(vram=[(100.0, 600), (101.0, 9000), (105.0, 14000), (106.0, 9100)], sample_starts={0: 104.5, 20: 200.0},
                worker_cpu={1: 3.0, 2: 1.5}, worker_cpu_at_start={1: 2.0}, supervisor_pid=2,
                trainer_cpu={7: 90.0, 8: 5.0}, reaped_cpu=97.5, bar_rate=2.5)
    values = {"status": "succeeded", "rate": 2.0, "step": 40, "output_dir": str(tmp_path),
              "started_at": "2026-12-06T10:00:00+00:00", "training_started_at": "2026-12-06T10:00:31.5+00:00",
              "finished_at": "2026-12-06T10:00:51.5+00:00", **job}
    return Outcome(values, [("launching", 10.0), ("loading_model", 14.0), ("caching_latents", 35.0),
                            ("training", 41.5)], seen, 600, 60.0)


def sample_image(tmp_path: Path, name: str, mtime: float) -> None:
    path = tmp_path / "sample" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"png")
    os.utime(path, (mtime, mtime))


def test_a_runs_rows_say_where_each_figure_comes_from(tmp_path):
    sample_image(tmp_path, "gc_e000000_00_20261206100040_42.png", 108.0)
    rows = {r.measure: r for r in rows_of(SAMPLED, outcome(tmp_path), gpu_why=None)}
    assert rows["seconds per step"].value == pytest.approx(0.4)  # 1 / the bar's 2.5 it/s
    assert rows["  as the worker measured it"].value == pytest.approx(0.5)  # 1 / the row's rate
    assert rows["training phase per step"].value == pytest.approx(0.5)  # 20 s over 40 steps
    assert rows["pre-training phase"].value == pytest.approx(31.5)
    assert rows["  loading_model"].value == pytest.approx(21.0) and "  training" not in rows
    assert rows["peak VRAM"].value == 14000 - 600
    first = rows["sample pass at step 0 (1024 px, 20 sampler steps)"]
    assert first.value == pytest.approx(3.5) and rows["  its peak VRAM"].value == 14000 - 600  # 104.5 to 108.0
    assert rows["sample pass at step 20 (1024 px, 20 sampler steps)"].why == (
        "its start was logged but no image of it is on disk")
    # gunicorn (pid 1) used 1 s more than at the POST, the supervisor (pid 2) 1.5 s; the trainer the larger of the
    # sum of its processes' last readings (95 s) and what the supervisor reaped (97.5 s)
    assert rows["CPU: gunicorn / supervisor / trainer"].text == "1.0 s / 1.5 s / 97.5 s"
    assert rows["worker's CPU share"].value == pytest.approx(2.5)


def test_on_the_cpu_rig_vram_is_a_row_saying_why_and_a_failed_job_fails(tmp_path):
    rows = rows_of(SAMPLED, outcome(tmp_path, status="failed", failure_class="cuda_oom", error="CUDA out of memory"),
                   gpu_why="simulated card")
    by = {r.measure: r for r in rows}
    assert by["job"].ok is False and "cuda_oom" in by["job"].text
    assert by["peak VRAM"].why == "simulated card"
    assert "  its peak VRAM" not in by


def test_a_job_the_service_refused_is_one_failed_row(tmp_path):
    out = Outcome({"status": "refused", "error": "POST /train answered 409"}, [], Seen(), None, 0.1)
    (row,) = rows_of(SAMPLED, out, gpu_why=None)
    assert row.ok is False and "refused" in row.text


def test_a_sampled_run_asks_for_its_prompt_as_any_job_and_a_plain_one_for_none():
    """The sample pass is the worker's own (dispatch/samples.py): the request's `samples` and the rig sizes'
    `sample_steps`, passes at the start and at each save; a plain run asks for none (no default prompt either)."""
    plain = RunSpec("768 px", "fast", 768, 16, 40, 20)
    assert "sample_steps" not in plain.sizes() and plain.samples() == []
    settings = Settings(sandbox="none", rig_tier_sizes={"quality": SAMPLED.sizes()})
    assert settings.sample_steps("quality") == 20 and settings.tiers["quality"].resolution == 1024
    assert settings.save_every_n_steps("quality") == 20  # the interval of its passes
    assert SAMPLED.samples() == [{"prompt": "ohwx dog, sitting on grass", "seed": 42}]
    request = TrainRequest(dataset_dir="/t/gc/dataset", base_model_path="/m/sdxl.safetensors",
                           output_dir="/t/gc/output", output_name="gc", trigger="ohwx", subject_class="dog", repeats=1,
                           tier="quality", device_index=0, seed=42, samples=tuple(SAMPLED.samples()))
    resolved = resolve_request(request, train_id="gc", dataset_dir=Path("/t/gc/dataset"),
                               base_model_path=Path("/m/sdxl.safetensors"), output_dir=Path("/t/gc/output"),
                               tiers=settings.tiers)
    found = prompts_file(resolved.samples, resolved.tier, settings, LocalBackend())
    assert found is not None and json.loads(found.data)[0]["width"] == 1024
    assert json.loads(found.data)[0]["sample_steps"] == 20


def test_the_generated_images_are_pngs_of_the_size_asked():
    data = png(64, 3)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    assert (width, height) == (64, 64) and len(zlib.decompress(data[idat + 4:idat + 4 + length])) == 64 * (1 + 3 * 64)
    assert png(64, 3) != png(64, 4)


def test_the_watcher_reads_the_sample_pass_lines_the_bar_and_the_loaders_matches(tmp_path):
    log = tmp_path / "job-1.log"
    log.write_bytes("U-Net: <All keys matched successfully>\n"
                    "steps:  67%|██████▋   | 2/3 [04:29<02:14, 134.97s/it, avr_loss=1.08]\n"
                    "generating sample images at step / サン".encode())
    watcher = Watcher([], log, None, 0)
    watcher._tick()
    assert watcher.seen.sample_starts == {} and watcher.seen.keys_matched == 1
    assert watcher.seen.bar_rate == pytest.approx(1 / 134.97)
    with log.open("ab") as fh:
        fh.write("プル画像生成 ステップ: 0\nprompt: ohwx dog\n".encode())
    before = time.time()
    watcher._tick()
    assert list(watcher.seen.sample_starts) == [0] and watcher.seen.sample_starts[0] >= before
    assert SAMPLE_START.search("generating sample images at step / サンプル画像生成 ステップ: 20").group(1) == "20"


# -- what travels ---------------------------------------------------------------------------------------------

def test_the_tokenizer_folders_hold_the_byte_tokens_the_merges_and_the_two_specials(tmp_path):
    bpe = tmp_path / "bpe.txt.gz"
    bpe.write_bytes(gzip.compress(b"#version: 0.2\nt h\nth e</w>\n"))
    encoder, merges = vocabulary(gzip.decompress(bpe.read_bytes()).decode())
    assert merges == [("t", "h"), ("th", "e</w>")]
    assert len(encoder) == 512 + 2 + 2 and encoder["the</w>"] == 513 and encoder["<|endoftext|>"] == 515
    write_folders(bpe, tmp_path / "tok")
    for name, pad in FOLDERS.items():
        folder = tmp_path / "tok" / name
        assert json.loads((folder / "vocab.json").read_text(encoding="utf-8")) == encoder
        assert (folder / "merges.txt").read_text(encoding="utf-8") == "#version: 0.2\nt h\nth e</w>\n"
        assert json.loads((folder / "special_tokens_map.json").read_text())["pad_token"] == pad


@pytest.mark.slow
def test_the_sd_scripts_tarball_is_exactly_the_commits_files_with_a_head_naming_it(tmp_path, monkeypatch):
    repo = tmp_path / "sd"
    (repo / "library").mkdir(parents=True)
    (repo / "library" / "util.py").write_text("x = 1\n")
    (repo / "train.py").write_text("print()\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(pins, "SD_SCRIPTS_COMMIT", commit)
    (repo / "library.egg-info").mkdir()
    (repo / "library.egg-info" / "PKG-INFO").write_text("gained since\n")
    (repo / "train.py").unlink()  # a file the checkout lacks is named, not invented
    got, absent = bundle.sd_scripts_tar(repo, tmp_path / "sd.tar.gz")
    assert (got, absent) == (commit, ["train.py"])
    with tarfile.open(tmp_path / "sd.tar.gz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
        assert names == ["sd-scripts/.git/HEAD", "sd-scripts/.git/config", "sd-scripts/library/util.py"]
        tar.extractall(tmp_path / "out", filter="data")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path / "out" / "sd-scripts", capture_output=True,
                          text=True, check=True).stdout.strip()
    assert head == commit
    (repo / "library" / "util.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match="differ"):
        bundle.sd_scripts_tar(repo, tmp_path / "again.tar.gz")


@pytest.mark.slow
def test_the_device_script_parses_and_refuses_an_unknown_step(tmp_path):
    script = Path(bundle.__file__).parent / "device.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(["bash", str(script), "what"], capture_output=True, text=True, check=False,
                          env={**os.environ, "LW_GPU_ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.slow
def test_a_hang_before_the_runs_ends_within_the_budget_and_the_table_is_still_written(tmp_path):
    """The device call's limit kills a check that overruns its budget, and a killed check writes no table: a step
    before the runs (here the trainer's interpreter, hanging) must be cut at the budget, not at its own timeout."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    hanging = venv / "bin" / "python"
    hanging.write_text("#!/bin/sh\nexec sleep 600\n")
    hanging.chmod(0o755)
    out = tmp_path / "out"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu", "--budget-s", "2",
                           "--trainer-venv", str(venv), "--sd-scripts", str(tmp_path), "--tokenizers", str(tmp_path),
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode != 0 and time.monotonic() - started < 60  # its own timeout was 300 s
    table = (out / "gpu-check.md").read_text()
    assert "stopped" in table and "TimeoutExpired" in table
