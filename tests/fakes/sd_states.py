"""The fake trainer's states (`--save_state`, `--resume`), as sd-scripts (48d368fa) and accelerate 1.6.0 write and
read them, without torch:

- a state directory is what `accelerator.save_state` leaves: `model.safetensors` (the network's weights, in the
  float32 it trains in, metadata {"format": "pt"}), `optimizer.bin`, `scheduler.bin`, `random_states_0.pkl`
  (each a zip archive laid out as torch.save lays one out: `<stem>/data.pkl`, `<stem>/byteorder`,
  `<stem>/data/<n>`, `<stem>/version`, `<stem>/.data/serialization_id`, stored uncompressed; the pickles hold
  plain values and the tensor data is a few bytes, so it is cheap), and sd-scripts' `train_state.json`
  (`{"current_epoch": E, "current_step": S}`, written by train_network's save hook before the rest);
- every file is written in place, not atomically and not fsynced (as torch.save and safetensors do);
- the lines: train_util's `saving state at step N` (after an empty log line), accelerate's `Saving current state
  to …` and one `… saved in …` per file, train_network's `save train state to …`, and `removing old state: …`;
- the pruning arithmetic of train_util's get_remove_step_no and save_and_remove_state_stepwise;
- the resume: `resume training from local state: …`, accelerate's `Loading states from …`, the load hook's
  `load train state from …: {…}`, and the files read (a missing one is the FileNotFoundError torch raises, a
  cut one torch's `RuntimeError: PytorchStreamReader failed reading zip archive: …`, a broken
  `random_states_0.pkl` only `Could not load random states`, which the rig's trainer printed on every resume).

What the real trainer writes and prints here is held to the rig's runs by tests/test_fake_rig.py.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import struct
import zipfile

STEP_STATE_NAME = "{}-step{:08d}-state"
LAST_STATE_NAME = "{}-state"
TORCH_ALIGNMENT = 64  # torch's zip writer aligns each record's data to 64 bytes


def torch_save(path: str, value: object, tensors: list[bytes]) -> None:
    """A file shaped as torch.save's zip format writes it: records named `<stem>/…`, stored, 64-byte aligned."""
    stem = os.path.basename(path).split(".", 1)[0]
    records = [("data.pkl", pickle.dumps(value, protocol=2)), (".format_version", b"1"),
               (".storage_alignment", b"64"), ("byteorder", b"little")]
    records += [(f"data/{i}", data) for i, data in enumerate(tensors)]
    records += [("version", b"3\n"), (".data/serialization_id", b"%040d" % len(tensors))]
    with open(path, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            info = zipfile.ZipInfo(f"{stem}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            header_end = fh.tell() + 30 + len(info.filename) + 4  # the local header, then a padding extra field
            pad = -header_end % TORCH_ALIGNMENT
            info.extra = struct.pack("<HH", 0xFE, pad) + b"Z" * pad
            archive.writestr(info, data)


def state_model(path: str, modules: list[tuple[str, int, int]], rank: int, alpha: float) -> None:
    """The network's weights as accelerate saves them (safetensors, float32, {"format": "pt"}); data sparse."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    alphas = []
    for name, in_features, out_features in modules:
        for key, shape in ((f"{name}.alpha", []), (f"{name}.lora_down.weight", [rank, in_features]),
                           (f"{name}.lora_up.weight", [out_features, rank])):
            size = 4
            for n in shape:
                size *= n
            header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            if key.endswith(".alpha"):
                alphas.append(offset)
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        start = fh.tell()
        for at in alphas:
            fh.seek(start + at)
            fh.write(struct.pack("<f", alpha))
        fh.truncate(start + offset)


def save_state(log, state_dir: str, *, epoch: int, step: int, modules: list[tuple[str, int, int]], rank: int,
               alpha: float, lr: float) -> None:
    """accelerator.save_state(state_dir) with train_network's save hook; `log` writes one log line."""
    os.makedirs(state_dir, exist_ok=True)
    log(f"Saving current state to {state_dir}")
    train_state = os.path.join(state_dir, "train_state.json")
    log(f"save train state to {train_state} at epoch {epoch} step {step}")
    with open(train_state, "w", encoding="utf-8") as f:
        json.dump({"current_epoch": epoch, "current_step": step}, f)
    model = os.path.join(state_dir, "model.safetensors")
    state_model(model, modules, rank, alpha)
    log(f"Model weights saved in {model}")
    optimizer = os.path.join(state_dir, "optimizer.bin")
    torch_save(optimizer, {"state": {0: {"step": step}}, "param_groups": [{"lr": lr, "params": [0]}]},
               [b"\0" * 64, b"\0" * 64])
    log(f"Optimizer state saved in {optimizer}")
    scheduler = os.path.join(state_dir, "scheduler.bin")
    torch_save(scheduler, {"last_epoch": step, "_step_count": step + 1, "base_lrs": [lr]}, [])
    log(f"Scheduler state saved in {scheduler}")
    # accelerate logs both dataloaders' sampler files (train and validation) but writes neither: only a
    # SeedableRandomSampler is saved, and sd-scripts has none (the rig's states hold no sampler file)
    for i, sampler in enumerate(("sampler.bin", "sampler_1.bin")):
        log(f"Sampler state for dataloader {i} saved in {os.path.join(state_dir, sampler)}")
    states = os.path.join(state_dir, "random_states_0.pkl")
    torch_save(states, {"step": 0, "random_state": None, "numpy_random_seed": None}, [b"\0" * 16])
    log(f"Random states saved in {states}")


def save_and_remove_state_stepwise(log, args, step: int, **state: object) -> None:
    """train_util.save_and_remove_state_stepwise."""
    name = args.output_name or "at"
    log("")
    log(f"saving state at step {step}")
    os.makedirs(args.output_dir, exist_ok=True)
    save_state(log, os.path.join(args.output_dir, STEP_STATE_NAME.format(name, step)), step=step, **state)
    last_n = args.save_last_n_steps_state if args.save_last_n_steps_state else args.save_last_n_steps
    if last_n is not None:
        remove = step - last_n - 1
        remove -= remove % args.save_every_n_steps
        if remove > 0:
            old = os.path.join(args.output_dir, STEP_STATE_NAME.format(name, remove))
            if os.path.exists(old):
                log(f"removing old state: {old}")
                shutil.rmtree(old)


def save_state_on_train_end(log, args, **state: object) -> None:
    """train_util.save_state_on_train_end."""
    log("")
    log("saving last state.")
    os.makedirs(args.output_dir, exist_ok=True)
    save_state(log, os.path.join(args.output_dir, LAST_STATE_NAME.format(args.output_name or "last")), **state)


def get_remove_step_no(args, step: int) -> int | None:
    """train_util.get_remove_step_no: the step LoRA a save at `step` removes."""
    if args.save_last_n_steps is None:
        return None
    remove = step - args.save_last_n_steps - 1
    remove -= remove % args.save_every_n_steps
    return None if remove < 0 else remove


def resume_from_local_or_hf_if_specified(log, args) -> int | None:
    """train_util.resume_from_local_or_hf_if_specified → accelerator.load_state, with train_network's load hook:
    the `current_step` of train_state.json (None without one, as the hook has it: the run then trains from 0)."""
    log(f"resume training from local state: {args.resume}")
    return load_state(log, args.resume)


def load_state(log, state_dir: str) -> int | None:
    """Accelerator.load_state: the load hook (train_state.json) first, then the files."""
    log(f"Loading states from {state_dir}")
    steps = None
    train_state = os.path.join(state_dir, "train_state.json")
    if os.path.exists(train_state):
        with open(train_state, encoding="utf-8") as f:
            data = json.load(f)
        steps = data["current_step"]
        log(f"load train state from {train_state}: {data}")
    load_accelerator_state(log, state_dir)
    return steps


def load_accelerator_state(log, state_dir: str) -> None:
    """accelerate 1.6 checkpointing.load_accelerator_state: each file read in turn, a broken one raising what
    torch raises, except the RNG states, whose failure is only logged (L276-297)."""
    model = os.path.join(state_dir, "model.safetensors")
    if not os.path.isfile(model):  # accelerate falls back to torch's name for the weights
        load(os.path.join(state_dir, "pytorch_model.bin"))
    log("All model weights loaded successfully")
    load(os.path.join(state_dir, "optimizer.bin"))
    log("All optimizer states loaded successfully")
    load(os.path.join(state_dir, "scheduler.bin"))
    log("All scheduler states loaded successfully")
    log("All dataloader sampler states loaded successfully")  # no seedable sampler: nothing is read
    try:
        load(os.path.join(state_dir, "random_states_0.pkl"))
    except Exception:
        pass  # swallowed, as accelerate does: a broken file and a good one print the same line
    # The real load goes on to set the CUDA RNG from a key a CPU box never saves, and its `except Exception` logs
    # this: the rig's resumes all printed it (a GPU's would print `All random states loaded successfully`, from
    # source). The fake prints what the real trainer was seen to print, on every resume.
    log("Could not load random states")
    log("Loading in 0 custom states")


def load(path: str) -> None:
    """torch.load of a torch.save zip: a missing file is the FileNotFoundError open raises, a cut one torch's
    reader's RuntimeError (the rig's R7)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile:
        bad = "the central directory"
    if bad is not None:
        raise RuntimeError(TORCH_ZIP_ERROR)


TORCH_ZIP_ERROR = ("PytorchStreamReader failed reading zip archive: failed finding central directory. This is an "
                   "internal miniz error. If you are seeing this error, there is a high likelihood that your "
                   "checkpoint file is corrupted. This can happen if the checkpoint was not saved properly, was "
                   "transferred incorrectly, or the file was modified after saving.")
