"""A caption's CLIP tokens, counted as the trainer's two tokenizers count them (host/clip_tokens.py): a table the
REAL tokenizers made on the rig (tests/data/clip/token_counts.json, 1500 captions of every kind), replayed here with
CLIP's own merges (tests/data/clip/merges.txt.gz: the rig's, built from open_clip's BPE file as HF's are).
tests/rig/test_real_tokens.py holds the table and fresh captions to the real tokenizers again."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lora_worker.host.clip_tokens import CONTENT_TOKENS, ClipBpe, load_counter, parse_merges, parse_specials
from lora_worker.host.trainer import TOKENIZER_DIRS, FileUnusable
from tests.helpers.captions import clip_tokenizer_cache

DATA = Path(__file__).resolve().parent.parent / "data" / "clip"
TABLE = json.loads((DATA / "token_counts.json").read_text())["rows"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, ClipBpe]:
    ranks = parse_merges(gzip.decompress((DATA / "merges.txt.gz").read_bytes()))
    return {name: ClipBpe(ranks, parse_specials((DATA / f"{name}_tokenizer_config.json").read_bytes()))
            for name in ("clip_l", "bigg")}


def test_every_caption_of_the_real_tokenizers_table_counts_the_same(tokenizers):
    wrong = [(row["caption"], name, tokenizers[name].count(row["caption"]), row[name])
             for row in TABLE for name in ("clip_l", "bigg") if tokenizers[name].count(row["caption"]) != row[name]]
    assert wrong == []
    assert len(TABLE) == 1500
    # the table holds what matters: captions past 75 tokens, and captions the two tokenizers count apart
    assert sum(max(r["clip_l"], r["bigg"]) > CONTENT_TOKENS for r in TABLE) > 100
    assert sum(r["clip_l"] != r["bigg"] for r in TABLE) > 100


@pytest.mark.parametrize("caption, clip_l, bigg", [
    ("a photo of ohwx dog, sitting on the grass", 10, 10),  # sd-scripts-real-run.md §1: ten ids between BOS and EOS
    ("wow!!", 2, 3),  # bigG's pad token is `!`, split out before anything else
    ("<|ENDOFTEXT|> a", 2, 2),  # lower-cased, then the tokenizer's pattern takes the special token's text whole
    ("“quoted” ﬁne café ＡＢＣ", 6, 6),  # ftfy: straight quotes, no ligature, halfwidth letters
])
def test_known_captions(tokenizers, caption, clip_l, bigg):
    assert (tokenizers["clip_l"].count(caption), tokenizers["bigg"].count(caption)) == (clip_l, bigg)


def cache_dir(root: Path) -> Path:
    return clip_tokenizer_cache(root)


def test_the_counter_of_a_tokenizer_cache_takes_the_larger_count_and_rereads_a_changed_file(tmp_path):
    root = cache_dir(tmp_path / "tok")
    counter = load_counter(root)
    assert counter.count("wow!!") == 3
    assert load_counter(root).tokenizers[0] is counter.tokenizers[0]  # unchanged files: not parsed again
    config = root / TOKENIZER_DIRS[1] / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"pad_token": "!"', '"pad_token": "<|endoftext|>"'))
    assert load_counter(root).count("wow!!") == 2


def test_a_broken_tokenizer_file_is_named(tmp_path):
    root = cache_dir(tmp_path / "tok")
    (root / TOKENIZER_DIRS[0] / "merges.txt").write_text("no version line\n")
    with pytest.raises(FileUnusable, match="merges.txt.*#version"):
        load_counter(root)
