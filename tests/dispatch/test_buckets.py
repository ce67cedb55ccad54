"""sd-scripts' bucket arithmetic (dispatch/buckets.py) and the one presentation of a dataset (dispatch/presentation.py).
The arithmetic is held to the real trainer's printed tables on the rig (tests/rig/test_real_buckets.py); here, its
cases as sd-scripts' own BucketManager answers them (read off the rig), and the mean's summation to numpy's own (the
same numpy as the rig's venv, 2.4.6)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from lora_worker.dispatch.buckets import NoBucket, bucket_table, pairwise_sum, select_bucket
from lora_worker.dispatch.presentation import SavedState, presentation


@pytest.mark.parametrize("size, resolution, bucket, resized", [
    ((1024, 1024), 1024, (1024, 1024), (1024, 1024)),  # at the resolution: as it is
    ((700, 500), 1024, (640, 448), (700, 500)),  # smaller: its own size, floored to 64 (no upscale)
    ((2000, 1500), 1024, (1088, 832), (1109, 832)),  # larger: area 1024², the rounding nearer its aspect
    ((1920, 1080), 768, (1024, 576), (1024, 576)),
    ((64, 64), 768, (64, 64), (64, 64)),
])
def test_select_bucket(size, resolution, bucket, resized):
    chosen = select_bucket(*size, resolution)
    assert (chosen.resolution, chosen.resized) == (bucket, resized)
    assert chosen.ar_error == bucket[0] / bucket[1] - size[0] / size[1]


@pytest.mark.parametrize("size", [(63, 500), (500, 63), (20000, 20), (0, 10)])
def test_an_edge_under_64_has_no_bucket(size):
    with pytest.raises(NoBucket):
        select_bucket(*size, 768)


def test_the_mean_is_summed_as_numpy_sums_it_to_the_last_bit():
    rng = random.Random(3)
    for n in [1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 255, 256, 257, 1000]:
        values = [abs(rng.random() * rng.choice([1e-3, 1.0, 3.0])) for _ in range(n)]
        assert pairwise_sum(values) / n == float(np.mean(np.abs(np.array(values)))), n


def test_the_table_counts_repeats_sorts_buckets_and_prints_the_trainers_lines():
    buckets = [select_bucket(w, h, 1024) for w, h in [(1024, 1024), (832, 1216), (1024, 1024), (700, 500)]]
    table = bucket_table(buckets, repeats=10)
    assert table.lines()[:3] == ["bucket 0: resolution (640, 448), count: 10",
                                 "bucket 1: resolution (832, 1216), count: 10",
                                 "bucket 2: resolution (1024, 1024), count: 20"]
    assert table.lines()[3] == f"mean ar error (without repeats): {float(np.mean([abs(b.ar_error) for b in buckets]))}"
    assert bucket_table([], 3).lines() == ["mean ar error (without repeats): 0"]


def test_the_presentation_says_batches_epochs_and_the_states_a_resume_could_use():
    buckets = [select_bucket(w, h, 768) for w, h in [(768, 768)] * 3 + [(500, 300)] * 2]
    # a row accepted before issue 32 was shown the kohya folder's own repeats
    shown = presentation(5, 2, 400, 150, buckets, folder_repeats=10)
    assert (shown.images_x_repeats, shown.first_epoch_steps_at_least) == (50, 25)
    assert shown.steps_per_epoch == 15 + 10 and shown.epochs == 16
    odd = presentation(5, 2, 400, 150, buckets, folder_repeats=3)  # 9 and 6 per bucket: 5 + 3 batches
    assert (odd.steps_per_epoch, odd.first_epoch_steps_at_least) == (8, 8)
    before = presentation(20, 1, 400, 150, folder_repeats=10)
    assert [(s.step, s.resumable) for s in before.states] == [(150, True), (300, False)]
    # every job now: the smallest repeats that make one epoch of the steps asked, whatever the buckets round up
    now = presentation(5, 2, 401, 150, buckets)
    assert (now.repeats, now.images_x_repeats, now.first_epoch_steps_at_least) == (161, 805, 403)
    assert now.steps_per_epoch == 242 + 161 and now.epochs == 1
    assert [(s.step, s.resumable) for s in presentation(20, 1, 400, 150).states] == [(150, True), (300, True)]
    assert presentation(20, 1, 400, 200).states[-1] == SavedState(400, False)  # the last step: nothing left
