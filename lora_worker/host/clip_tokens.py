"""How many CLIP tokens the trainer reads of a caption, counted as its own tokenizers count them.

sd-scripts (48d368fa) tokenizes each caption with transformers' slow `CLIPTokenizer`, once per SDXL text encoder
(strategy_sdxl.py L24-26), `truncation=True` at `model_max_length` 77 (strategy_base.py L228-234): BOS, the first
75 tokens, EOS. Whatever follows the 75th is dropped without a word. The two tokenizers share one BPE (the same
merges.txt) but not their special tokens: bigG's pad token is `!`, and transformers splits a text on every special
token before anything else, so `wow!!` is 2 tokens to CLIP-L (`wow</w> !!</w>`) and 3 to bigG (`wow</w> ! !`).
Both are counted; the larger decides.

The steps are transformers 4.54.1's (models/clip/tokenization_clip.py), re-implemented, not copied: split on the
special tokens (PreTrainedTokenizer.tokenize); each other piece through ftfy's `fix_text` (sd-scripts pins ftfy, and
with it installed the tokenizer uses it, L296-304), runs of whitespace made one space and stripped, lower-cased
(L465); split by the tokenizer's pattern (L318-321, with the `regex` module, as it does); each piece's UTF-8 bytes
mapped to characters (`bytes_to_unicode`, L38-73) and merged by the BPE ranks of merges.txt (`bpe`, L400-440).
tests/host/test_clip_tokens.py replays a table of counts the real tokenizers made; tests/rig/ holds the two
together on the rig.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import ftfy
import regex

from lora_worker.host.trainer import (TOKENIZER_DIRS, FileUnusable, check_merges, check_tokenizer_config,
                                     read_checked)

CONTENT_TOKENS = 75  # model_max_length 77 less BOS and EOS: what survives the truncation
# tokenization_clip.py L313: the merges the tokenizer reads, after the `#version` line
MERGES_READ = 49152 - 256 - 2
PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE)
WHITESPACE = regex.compile(r"\s+")
# The two tokens whose BPE is themselves (the tokenizer's cache starts with them, L316)
WHOLE = frozenset({"<|startoftext|>", "<|endoftext|>"})
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters, which CLIP's merges are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


BYTE_CHARS = _bytes_to_unicode()


@dataclass
class ClipBpe:
    """One tokenizer folder's merges and special tokens, and the BPE of the words seen so far."""

    ranks: dict[tuple[str, str], int]
    specials: frozenset[str]
    _split: regex.Pattern[str] = field(init=False, repr=False)
    _cache: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        alternatives = sorted(self.specials, key=len, reverse=True)  # the longest first, as the trie matches
        self._split = regex.compile("(" + "|".join(regex.escape(s) for s in alternatives) + ")")

    def count(self, text: str) -> int:
        """The tokens of `text` between BOS and EOS, untruncated."""
        total = 0
        for piece in self._split.split(text):
            if piece in self.specials:
                total += 1
            elif piece:
                cleaned = WHITESPACE.sub(" ", ftfy.fix_text(piece)).strip().lower()
                total += sum(self._word(word) for word in PATTERN.findall(cleaned))
        return total

    def _word(self, word: str) -> int:
        token = "".join(BYTE_CHARS[b] for b in word.encode("utf-8"))
        if token in WHOLE:
            return 1
        if token not in self._cache:
            if len(self._cache) > 50_000:  # a bound on what one caller's captions can make it hold
                self._cache.clear()
            self._cache[token] = len(merge(token, self.ranks))
        return self._cache[token]


def merge(token: str, ranks: dict[tuple[str, str], int]) -> tuple[str, ...]:
    """CLIP's BPE of one pre-token: the last character carries `</w>`; the lowest-ranked adjacent pair is merged
    everywhere, left to right, until no pair has a rank."""
    word = (*token[:-1], token[-1] + "</w>")
    while len(word) > 1:
        pairs = set(zip(word, word[1:]))
        best = min(pairs, key=lambda pair: ranks.get(pair, MERGES_READ))
        if best not in ranks:
            break
        word = _merged(word, best)
    return word


def _merged(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i < len(word) - 1 and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


@dataclass
class CaptionCounter:
    """Both SDXL tokenizers of a `--tokenizer_cache_dir`."""

    tokenizers: tuple[ClipBpe, ...]

    def count(self, caption: str) -> int:
        """The most tokens any of the trainer's tokenizers makes of the caption (before its truncation)."""
        return max(t.count(caption) for t in self.tokenizers)


def parse_merges(data: bytes) -> dict[tuple[str, str], int]:
    lines = data.decode("utf-8").strip().split("\n")[1:MERGES_READ + 1]
    return {(parts[0], parts[1]): rank for rank, line in enumerate(lines) if len(parts := line.split()) == 2}


def parse_specials(data: bytes) -> frozenset[str]:
    """The special tokens a tokenizer_config.json names (strings, or {"content": …} as newer ones write them)."""
    config = json.loads(data.decode("utf-8"))
    found = set()
    for key in SPECIAL_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            found.add(value)
    return frozenset(found)


def load_counter(tokenizer_cache_dir: Path) -> CaptionCounter:
    """The counter of the trainer's two tokenizer folders, read with the checks the preflight makes of them
    (host/trainer.py); FileUnusable names the file that fails."""
    return CaptionCounter(tuple(_load(tokenizer_cache_dir / name) for name in TOKENIZER_DIRS))


_LOADED: dict[tuple[str, str], tuple[tuple[int, ...], ClipBpe]] = {}


def _load(folder: Path) -> ClipBpe:
    """A folder's BPE, read again only when one of its two files changed (another inode, size or ctime)."""
    merges, config = folder / "merges.txt", folder / "tokenizer_config.json"
    key = (str(merges), str(config))
    identity = (*_identity(merges), *_identity(config))
    cached = _LOADED.get(key)
    if cached is None or cached[0] != identity:
        bpe = ClipBpe(parse_merges(read_checked(merges, check_merges)),
                      parse_specials(read_checked(config, check_tokenizer_config)))
        if len(_LOADED) >= 4:
            _LOADED.clear()
        _LOADED[key] = cached = (identity, bpe)
    return cached[1]


def _identity(path: Path) -> tuple[int, ...]:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise FileUnusable(f"tokenizer file {path}: cannot be read ({exc.strerror or exc})") from exc
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
