"""The two offline CLIP tokenizer folders sd-scripts' `--tokenizer_cache_dir` reads, from open_clip's BPE file
(`bpe_simple_vocab_16e6.txt.gz` in the open_clip_torch 2.20.0 wheel), the way HF's CLIP conversion builds them:
the 512 byte tokens, the merges, the two special tokens (vocab 49408 from the real file, 48894 merges).

The same files, byte for byte, as the CPU rig's ../shared/rig/make_tokenizers.py writes (tests/rig checks it).
Pure Python: `make gpu-bundle` builds them here and the GPU machine only unpacks them. (Not named `tokenizers`:
make_sdxl.py runs from this folder, where such a module would hide the trainer's `tokenizers` package.)

usage: python -m bench.gpu_check.clip_vocab BPE.txt.gz OUT_DIR
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

FOLDERS = {"openai_clip-vit-large-patch14": "<|endoftext|>", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k": "!"}
MERGES = 49152 - 256 - 2  # open_clip reads this many merge lines after the header


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def vocabulary(bpe_text: str) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    merges = [tuple(m.split()) for m in bpe_text.split("\n")[1:MERGES + 1] if m.strip()]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def write_folders(bpe_gz: Path, out: Path) -> list[Path]:
    with gzip.open(bpe_gz) as fh:
        encoder, merges = vocabulary(fh.read().decode("utf-8"))
    written = []
    for name, pad in FOLDERS.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "vocab.json", "w", encoding="utf-8") as fh:
            json.dump(encoder, fh, ensure_ascii=False)
        with open(d / "merges.txt", "w", encoding="utf-8") as fh:
            fh.write("#version: 0.2\n")
            for m in merges:
                fh.write(" ".join(m) + "\n")
        special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                   "pad_token": pad}
        with open(d / "special_tokens_map.json", "w") as fh:
            json.dump(special, fh, indent=2)
        cfg = {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True,
               "errors": "replace", "add_prefix_space": False, **special}
        with open(d / "tokenizer_config.json", "w") as fh:
            json.dump(cfg, fh, indent=2)
        written.append(d)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    for folder in write_folders(Path(sys.argv[1]), Path(sys.argv[2])):
        print("wrote", folder)
