"""The real trainer's runs with step states (tests/data/rig/, described in tests/data/README.md), read back: their
argv, their output as the supervisor's one pipe gives it, and that output as a sequence of events a test can
compare with the fake trainer's (paths made relative to the output dir, each `steps` redraw reduced to its
counts), plus the fake trainer run with a capture's argv."""
from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.helpers import DATA, set_modes
from tests.helpers.fake_trainer import ENV

RIG = DATA / "rig"
REDRAW = re.compile(r"\r(steps:[^\r\n]*)")
BAR_COUNTS = re.compile(r"\| *(\d+)/(\d+) \[[^\]]*?(, avr_loss=[\d.]+)?\]")


def meta(name: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((RIG / f"{name}.jsonl").read_text().split("\n", 1)[0])["meta"]
    return meta


def chunks(name: str) -> list[tuple[str, bytes]]:
    lines = (RIG / f"{name}.jsonl").read_text().splitlines()[1:]
    return [(c["stream"], base64.b64decode(c["b64"])) for c in map(json.loads, lines)]


def stream(name: str, only: str | None = None) -> bytes:
    """The capture's bytes in arrival order (both streams, as the supervisor's pipe has them), or one stream's."""
    return b"".join(data for s, data in chunks(name) if only in (None, s))


def flag(argv: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def events(data: bytes, out: str) -> list[str]:
    """The output as events: `bar n/total` (`+loss` when the redraw shows avr_loss) for each redraw of the steps
    bar, and every other line as it is, blank ones included, with the output dir written `<out>`."""
    text = data.decode().replace(out, "<out>")
    found: list[str] = []
    for i, part in enumerate(REDRAW.split(text)):
        if i % 2:
            m = BAR_COUNTS.search(part)
            assert m is not None, part
            found.append(f"bar {m[1]}/{m[2]}" + ("+loss" if m[3] else ""))
        else:
            found += [line for line in part.split("\n")]
    return [e for e in found if not e.startswith("\r")]  # other bars' redraws (caching) are not compared


def around(found: list[str], start: str, end: str) -> list[str]:
    """The events from the first `start` up to and including the first `end` after it."""
    lo = found.index(start)
    return found[lo:found.index(end, lo + 1) + 1]


def fake_argv(name: str, rig: dict, *, resume: str | None = None) -> list[str]:
    """A capture's argv pointed at a fake trainer install (`rig`: install_fake_trainer's paths, with model,
    dataset and out), the same flags in the same order; `--resume` names the state's directory in `out`."""
    real = meta(name)["argv"]
    out = flag(real, "output_dir")
    swap = {"pretrained_model_name_or_path": rig["model"], "tokenizer_cache_dir": rig["tokenizer_cache_dir"],
            "train_data_dir": rig["dataset"], "output_dir": rig["out"], "sample_prompts": rig.get("prompts"),
            "dataset_config": rig.get("config")}
    argv = [str(rig["accelerate"]), *real[1:7], "sdxl_train_network.py"]
    for arg in real[8:]:
        key = arg[2:].split("=", 1)[0]
        if key in swap:
            arg = f"--{key}={swap[key]}"
        elif key == "resume":
            arg = f"--resume={rig['out']}/{resume or Path(arg.split('=', 1)[1]).relative_to(out)}"
        argv.append(arg)
    return argv


def run_fake(name: str, rig: dict, *, merged: bool = False, **modes: object) -> subprocess.CompletedProcess[bytes]:
    """The fake trainer with the capture's argv; `merged`: stderr into stdout, one pipe as the supervisor's."""
    set_modes(rig["sd_scripts_dir"], **{"step_s": 0.2, **modes})  # slower than tqdm's 0.1 s: every redraw drawn
    return subprocess.run(fake_argv(name, rig), cwd=rig["sd_scripts_dir"], env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE, timeout=60,
                          start_new_session=True)
