"""The REAL sd-scripts (the CPU rig of ../shared/rig, path in LW_RIG_DIR) run directly, with the worker's argv
shape and environment, its output captured chunk by chunk the way tests/data/*.jsonl were made, its output dir
watched, and the whole process group SIGKILLed on a condition. Used by tests/rig/ and to capture tests/data/rig/.

No torch here: the state files are described by name, size and `zipfile` alone.
"""
from __future__ import annotations

import base64
import ctypes
import json
import os
import selectors
import signal
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
# Every flag the worker passes (lora_worker/dispatch/argv.py), at the rig's size.
BASE_KEYS = {"save_model_as": "safetensors", "save_precision": "fp16", "caption_extension": ".txt",
             "resolution": "256", "network_module": "networks.lora", "mixed_precision": "bf16",
             "learning_rate": "1e-4", "lr_scheduler": "cosine", "optimizer_type": "AdamW8bit", "min_snr_gamma": "5",
             "noise_offset": "0.1", "max_grad_norm": "1.0", "train_batch_size": "1", "max_data_loader_n_workers": "0",
             "seed": "42"}
FLAGS = ("--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs", "--gradient_checkpointing",
         "--sdpa", "--enable_bucket", "--bucket_no_upscale", "--console_log_simple")
# The worker's allow-listed trainer environment (host/trainer.py trainer_env).
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0",
       "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
       "COLUMNS": "250"}


def argv(rig: Path, dataset: Path, out: Path, *, steps: int, dim: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    keys = {"pretrained_model_name_or_path": str(rig / "models/sdxl_random.safetensors"),
            "tokenizer_cache_dir": str(rig / "tokenizers"), "train_data_dir": str(dataset), "output_dir": str(out),
            "output_name": "ohwx", **BASE_KEYS, "network_dim": str(dim), "network_alpha": str(dim),
            "max_train_steps": str(steps)}
    return [str(rig / "venv/bin/accelerate"), "launch", "--num_processes=1", "--num_machines=1",
            "--mixed_precision=bf16", "--dynamo_backend=no", "--num_cpu_threads_per_process=2",
            str(rig / "sd-scripts/sdxl_train_network.py"), *(f"--{k}={v}" for k, v in keys.items()), *FLAGS, *extra]


def env(home: Path) -> dict[str, str]:
    return {**ENV, "HOME": str(home), "HF_HOME": str(home / "hf")}


def listing(directory: Path) -> list[dict[str, Any]]:
    """Each file of a state dir: name, size, and whether it is a zip archive (torch.save's format) that tests
    intact (`testzip` reads every member and checks its CRC)."""
    rows = []
    for path in sorted(directory.iterdir()):
        is_zip = zipfile.is_zipfile(path)
        intact = None
        if is_zip:
            try:
                with zipfile.ZipFile(path) as z:
                    intact = z.testzip() is None
            except (zipfile.BadZipFile, OSError):
                intact = False
        rows.append({"name": path.name, "size": path.stat().st_size, "is_zip": is_zip, "zip_intact": intact})
    return rows


def safetensors_header(path: Path) -> dict[str, Any]:
    """The 8-byte little-endian length and the JSON header, nothing more."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(n))
    return header


@dataclass
class Capture:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    chunks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    rc: int | None = None
    wall_s: float = 0.0
    cancel: str | None = None

    def text(self, stream: str) -> str:
        return "".join(c["text"] for c in self.chunks if c["stream"] == stream)

    def jsonl(self, rewrite: Callable[[str], str] = lambda s: s) -> str:
        """tests/data's format: a meta line, then one line per read() chunk."""
        meta = {"argv": [rewrite(a) for a in self.argv], "cwd": rewrite(self.cwd),
                "env_added": {k: rewrite(v) for k, v in self.env.items()}, "rc": self.rc, "wall_s": self.wall_s,
                "cancel": self.cancel, "events": [json.loads(rewrite(json.dumps(e))) for e in self.events]}
        lines = [json.dumps({"meta": meta})]
        for c in self.chunks:
            raw = rewrite(c["text"]).encode() if rewrite(c["text"]) != c["text"] else base64.b64decode(c["b64"])
            lines.append(json.dumps({"t": c["t"], "stream": c["stream"], "b64": base64.b64encode(raw).decode(),
                                     "text": raw.decode("utf-8", "replace")}))
        return "\n".join(lines) + "\n"


def _snapshot(out: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for root, _dirs, files in os.walk(out):
        for name in files:
            path = Path(root, name)
            try:
                found[str(path.relative_to(out))] = path.stat().st_size
            except FileNotFoundError:
                pass
    return found


def _watch(out: Path, start: float, events: list[dict[str, Any]], stop: threading.Event) -> None:
    """Every 0.1 s: which files of the output dir appeared, grew or went away (a state's save and removal)."""
    before: dict[str, int] = {}
    while not stop.is_set():
        now = _snapshot(out)
        changed = {k: v for k, v in now.items() if before.get(k) != v}
        gone = sorted(set(before) - set(now))
        if changed or gone:
            events.append({"t": round(time.monotonic() - start, 3), "event": "files", "changed": changed,
                           "gone": gone})
        before = now
        stop.wait(0.1)


KillWhen = Callable[[str, str], bool]


def run(cmd: list[str], cwd: Path, environ: dict[str, str], out: Path, *, kill_when: KillWhen | None = None,
        timeout: float = 900.0, on_chunk: Callable[[float, str, str], None] | None = None) -> Capture:
    """Run the command in a new process group and read both pipes until EOF; SIGKILL the group once
    kill_when(stdout so far, stderr so far) holds. The harness is a subreaper, so the trainer is reaped here."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    cap = Capture(cmd, str(cwd), environ)
    start = time.monotonic()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(out, start, cap.events, stop), daemon=True)
    watcher.start()
    proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    seen = {"stdout": "", "stderr": ""}
    while sel.get_map():
        for key, _ in sel.select(timeout=1.0):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fileobj)
                continue
            t = round(time.monotonic() - start, 3)
            text = data.decode("utf-8", "replace")
            cap.chunks.append({"t": t, "stream": key.data, "b64": base64.b64encode(data).decode(), "text": text})
            seen[key.data] += text
            if on_chunk is not None:
                on_chunk(t, key.data, text)
            _maybe_kill(cap, proc.pid, start, kill_when is not None and kill_when(seen["stdout"], seen["stderr"]))
        _maybe_kill(cap, proc.pid, start, time.monotonic() - start > timeout)
    proc.stdout.close()
    proc.stderr.close()
    sel.close()
    cap.rc = proc.wait()
    _reap_orphans(cap, start)
    cap.wall_s = round(time.monotonic() - start, 3)
    cap.events.append({"t": cap.wall_s, "event": "exit", "rc": cap.rc})
    time.sleep(0.3)
    stop.set()
    watcher.join()
    return cap


def _maybe_kill(cap: Capture, pgid: int, start: float, now: bool) -> None:
    if now and cap.cancel is None:
        cap.cancel = "group_sigkill"
        cap.events.append({"t": round(time.monotonic() - start, 3), "event": "sigkill_group"})
        os.killpg(pgid, signal.SIGKILL)


def _reap_orphans(cap: Capture, start: float) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        cap.events.append({"t": round(time.monotonic() - start, 3), "event": "reaped", "pid": pid,
                           "rc": os.waitstatus_to_exitcode(status)})


def after_state(step: int) -> KillWhen:
    """True once `saving state at step <step>` was logged and a progress redraw came after it: the state is
    then complete and the older one removed (both happen before the step's postfix redraw, TN L1497-1516)."""
    marker = f"saving state at step {step}\n"
    mark: dict[str, int] = {}

    def check(stdout: str, stderr: str) -> bool:
        if "at" not in mark:
            if marker not in stdout:
                return False
            mark["at"] = len(stderr)
        return "\rsteps:" in stderr[mark["at"]:]
    return check
