"""`make gpu-bundle`: what the GPU check carries to a GPU machine that has no network, fetched here from PyPI and
Debian into `.gpu-bundle/` (ignored by git), in two parts, each under what one device call carries.

  .gpu-bundle/a/          bitsandbytes and transformers wheels (pins.PART_A): the first call installs them
  .gpu-bundle/b/trainer/  the trainer's other wheels (pins.PART_B_TRAINER)
  .gpu-bundle/b/worker/   the worker's runtime, exactly deploy/requirements.lock (hashes checked), and pip
  .gpu-bundle/b/sd-scripts.tar.gz   sd-scripts at the pinned commit, from a checkout of it (SD_SCRIPTS_DIR)
  .gpu-bundle/b/tokenizers/         the two offline CLIP tokenizer folders (built here: clip_vocab.py)
  .gpu-bundle/b/deb/      Debian's bubblewrap .deb (the image may have no bwrap), when apt-get can fetch it
  .gpu-bundle/manifest.json        every file with its size and sha256, each part's total

usage: python -m bench.gpu_check.bundle --sd-scripts DIR [--out .gpu-bundle]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from bench.gpu_check import pins
from bench.gpu_check.clip_vocab import write_folders
from lora_worker.config import REPO_ROOT

MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # what one device call carries: the working tree and the carried paths together
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")


def pip_download(dest: Path, *requirements: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", pins.PYTHON, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *requirements], check=True)  # noqa: S603 - a fixed argv


def sd_scripts_tar(checkout: Path, dest: Path) -> tuple[str, list[str]]:
    """Exactly the files of the pinned commit, each checked against its blob (`git hash-object`), as a tar.gz:
    nothing the checkout gained since (an egg-info, __pycache__) and nothing changed. Returns the commit and the
    commit's paths the checkout lacks (the CPU rig's mirror has no blob for three that SDXL never uses)."""
    def git(*args: str, stdin: str | None = None) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=True,
                              input=stdin).stdout

    commit = git("rev-parse", "HEAD").strip()
    if commit != pins.SD_SCRIPTS_COMMIT:
        raise SystemExit(f"{checkout}: HEAD is {commit!r}, not the pinned {pins.SD_SCRIPTS_COMMIT}")
    blobs = {}
    for line in git("ls-tree", "-r", "-z", commit).split("\0"):
        if line:
            meta, path = line.split("\t", 1)
            if meta.split()[1] == "blob":
                blobs[path] = meta.split()[2]
    present = [p for p in blobs if (checkout / p).is_file()]
    hashes = git("hash-object", "--no-filters", "--stdin-paths", stdin="\n".join(present) + "\n").split()
    changed = [p for p, h in zip(present, hashes) if h != blobs[p]]
    if changed:
        raise SystemExit(f"{checkout}: {len(changed)} file(s) differ from {commit}: {changed[:5]}")
    with tarfile.open(dest, "w:gz") as tar:
        for path in present:
            tar.add(checkout / path, arcname=f"sd-scripts/{path}", recursive=False)
        _git_head(tar, commit)
    return commit, sorted(set(blobs) - set(present))


def _git_head(tar: tarfile.TarFile, commit: str) -> None:
    """A `.git` that names the commit and holds no object: sd-scripts (its metadata's commit hash) and the worker's
    fingerprint read HEAD as `git rev-parse HEAD` does, and that answers from HEAD alone."""
    for folder in (".git", ".git/objects", ".git/refs", ".git/refs/heads"):
        info = tarfile.TarInfo(f"sd-scripts/{folder}")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    for name, text in (("HEAD", commit + "\n"), ("config", "[core]\n\trepositoryformatversion = 0\n\tbare = false\n")):
        data = text.encode()
        info = tarfile.TarInfo(f"sd-scripts/.git/{name}")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


def clip_tokenizers(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), f"open_clip_torch=={pins.OPEN_CLIP}")
        (wheel,) = Path(tmp).glob("open_clip_torch-*.whl")
        bpe = Path(tmp) / "bpe_simple_vocab_16e6.txt.gz"
        bpe.write_bytes(zipfile.ZipFile(wheel).read("open_clip/bpe_simple_vocab_16e6.txt.gz"))
        write_folders(bpe, dest)


def bubblewrap(dest: Path) -> str | None:
    """Debian's bubblewrap .deb into `dest`, or why not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not on this machine"
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["apt-get", "download", "bubblewrap"], cwd=dest, capture_output=True, text=True,
                          check=False)
    return None if done.returncode == 0 and list(dest.glob("bubblewrap_*.deb")) else done.stderr.strip()[-300:]


def tree_bytes() -> int:
    """What the working tree adds to each call: the tracked files (untracked ones travel too: keep them few)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return sum((REPO_ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (REPO_ROOT / n).is_file())


def manifest(out: Path, commit: str, notes: dict[str, str]) -> dict[str, object]:
    parts: dict[str, object] = {}
    for part in ("a", "b"):
        files = sorted(p for p in (out / part).rglob("*") if p.is_file())
        parts[part] = {"bytes": sum(p.stat().st_size for p in files),
                       "files": [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size,
                                  "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files]}
    return {"sd_scripts_commit": commit, "python": pins.PYTHON, "part_a": pins.PART_A,
            "part_b_trainer": pins.PART_B_TRAINER, "left_out": pins.LEFT_OUT, "notes": notes,
            "tree_bytes": tree_bytes(), "carry_limit_bytes": CARRY_LIMIT, "parts": parts}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check.bundle")
    parser.add_argument("--sd-scripts", type=Path, required=True, help="a checkout of sd-scripts at the pinned commit")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu-bundle")
    args = parser.parse_args(argv)
    if args.out.exists() and not (args.out / "manifest.json").exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty and not a bundle of ours: not removing it")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    (args.out / "manifest.json").write_text('{"complete": false}\n')  # ours, even if this run stops half way
    pip_download(args.out / "a", *(f"{n}=={v}" for n, v in pins.PART_A.items()))
    pip_download(args.out / "b" / "trainer", *(f"{n}=={v}" for n, v in pins.PART_B_TRAINER.items()))
    pip_download(args.out / "b" / "worker", "--require-hashes", "-r", str(REPO_ROOT / "deploy" / "requirements.lock"))
    pip_download(args.out / "b" / "worker", f"pip=={pins.PIP}")
    commit, absent = sd_scripts_tar(args.sd_scripts, args.out / "b" / "sd-scripts.tar.gz")
    clip_tokenizers(args.out / "b" / "tokenizers")
    notes = {"sd-scripts": f"{commit}: every file of the commit, checked against its blob"
             + (f"; absent from the checkout: {', '.join(absent)}" if absent else "")}
    if why := bubblewrap(args.out / "b" / "deb"):
        notes["bubblewrap"] = f"not bundled: {why}; the check uses the image's bwrap, else sandbox = none"
    doc = manifest(args.out, commit, notes)
    (args.out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    tree = int(doc["tree_bytes"])  # type: ignore[call-overload]
    for part, info in doc["parts"].items():  # type: ignore[attr-defined]
        total = info["bytes"] + tree
        print(f"part {part}: {info['bytes'] / MIB:.1f} MiB in {len(info['files'])} files; with the tracked tree "
              f"({tree / MIB:.1f} MiB): {total / MIB:.1f} of the {CARRY_LIMIT / MIB:.0f} MiB a call carries"
              + ("" if total <= CARRY_LIMIT else "  ** OVER **"))
    for name, note in notes.items():
        print(f"{name}: {note}")
    print(f"wrote {args.out}/manifest.json")
    return 0 if all(info["bytes"] + tree <= CARRY_LIMIT for info in doc["parts"].values()) else 1  # type: ignore


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
