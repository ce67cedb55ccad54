"""The worker's count of a caption's CLIP tokens (host/clip_tokens.py) against the REAL tokenizers sd-scripts loads
(transformers' CLIPTokenizer with ftfy, in the rig's venv, from the rig's --tokenizer_cache_dir): the committed
table (tests/data/clip/token_counts.json) and 3000 fresh captions of every kind. No model is loaded (seconds, no
flock needed). Opt-in: LW_RIG_DIR names the rig; without it these skip. A caption the lint calls over 75 tokens is
one the real tokenizer makes more than 77 ids of, and so truncates (`truncation=True`, strategy_base.py L228-234)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lora_worker.host.clip_tokens import CONTENT_TOKENS, load_counter
from tests.helpers.captions import corpus

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(600)]

RIG = os.environ.get("LW_RIG_DIR")
HERE = Path(__file__).resolve().parent


def real_counts(captions: list[str]) -> list[list[int]]:
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    done = subprocess.run([f"{RIG}/venv/bin/python", str(HERE / "count_clip_tokens.py"), RIG],
                          input=json.dumps(captions), capture_output=True, text=True, timeout=500, check=True)
    counts: list[list[int]] = json.loads(done.stdout)
    return counts


def test_the_committed_table_is_what_the_real_tokenizers_count():
    rows = json.loads((HERE.parent / "data/clip/token_counts.json").read_text())["rows"]
    assert real_counts([r["caption"] for r in rows]) == [[r["clip_l"], r["bigg"]] for r in rows]


def test_fresh_captions_count_as_the_real_tokenizers_count_them():
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    captions = corpus(2026, 3000)
    counter = load_counter(Path(RIG) / "tokenizers")
    ours = [[t.count(c) for t in counter.tokenizers] for c in captions]
    real = real_counts(captions)
    assert [(c, o, r) for c, o, r in zip(captions, ours, real) if o != r] == []
    over = [c for c, r in zip(captions, real) if max(r) > CONTENT_TOKENS]
    assert len(over) > 100 and all(counter.count(c) > CONTENT_TOKENS for c in over)
