"""The tokenizer cache the `host` fixture's hosts share (tests/conftest.py: tokenizers) is guarded by comparing
`tokenizer_identities` before and after each test: every way a test could change it must show there."""
from __future__ import annotations

import os
import time

import pytest

from lora_worker.host.trainer import TOKENIZER_DIRS, tokenizer_problems
from tests.helpers import shared_tokenizers, tokenizer_identities


def rewrite_in_place(vocab):
    time.sleep(0.02)  # past a coarse clock's tick: the same size, only its times (or nothing) say it changed
    with vocab.open("r+b") as fh:
        fh.write(b"{")


def replace_by_rename(vocab):
    other = vocab.with_name("other")
    other.write_bytes(vocab.read_bytes())
    os.replace(other, vocab)


@pytest.mark.parametrize("change", [rewrite_in_place, replace_by_rename, os.unlink,
                                    lambda vocab: vocab.with_name("extra.json").write_bytes(b"{}")])
def test_any_change_to_the_shared_tokenizers_changes_their_identities(tmp_path, change):
    folder = shared_tokenizers(tmp_path / "tokenizers")
    assert all(tokenizer_problems(folder / name) == [] for name in TOKENIZER_DIRS)
    before = tokenizer_identities(folder)
    assert tokenizer_identities(folder) == before  # reading them changes nothing
    change(folder / TOKENIZER_DIRS[0] / "vocab.json")
    assert tokenizer_identities(folder) != before


def test_the_host_fixtures_host_names_the_shared_cache_and_a_marked_test_gets_its_own(host, tokenizers):
    assert host.settings.tokenizer_cache_dir == tokenizers and not tokenizers.is_relative_to(host.root)


@pytest.mark.own_tokenizers
def test_a_test_marked_own_tokenizers_gets_a_cache_under_its_host(host, tokenizers):
    assert tokenizers is None and host.settings.tokenizer_cache_dir.is_relative_to(host.root)
