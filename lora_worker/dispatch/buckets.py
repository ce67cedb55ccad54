"""The bucket table sd-scripts will print at "make buckets", computed from each image's size before any GPU time.

The worker runs sd-scripts with `--enable_bucket --bucket_no_upscale` at the tier's `--resolution` R and the default
`--bucket_reso_steps` 64. Under `--bucket_no_upscale` no predefined buckets are made (train_util.py L1020-1034,
48d368fa): each image gets the bucket of its own size, by BucketManager.select_bucket's arithmetic (L308-343),
re-implemented here line for line:

- an image of area <= R² keeps its size; a larger one is scaled to area R² keeping its aspect ratio, and of the
  two roundings (width first, height first; `round_to_steps`, L280-282) the one nearer the aspect ratio is taken;
- the bucket is that size floored to multiples of 64 (L337-341), so an edge under 64 px becomes 0: sd-scripts then
  divides by zero (the aspect-ratio error, L346, or the rounding of L321-328) or trains an empty crop.

Then (L1056-1074) each bucket holds its images once per repeat; the buckets are sorted by (width, height) and each
non-empty one printed as `bucket {i}: resolution ({w}, {h}), count: {n}`, then `mean ar error (without repeats): x`,
x being numpy's mean of |bucket aspect - image aspect| over the images. numpy sums a float64 array pairwise
(numpy/_core/src/umath/loops_utils.h.src `pairwise_sum`), so the mean is summed the same way here, to the last bit:
the line is compared word for word with the real trainer's (tests/rig/test_real_buckets.py).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

RESO_STEPS = 64  # sd-scripts' --bucket_reso_steps default; the worker does not pass the flag
PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


class NoBucket(ValueError):
    """The image's bucket has an edge of 0 px: sd-scripts divides by zero on it, or trains an empty crop."""


@dataclass(frozen=True)
class Bucket:
    resolution: tuple[int, int]
    resized: tuple[int, int]  # the size the image is resized to before its crop to the bucket
    ar_error: float


def round_to_steps(x: float) -> int:
    """train_util.py L280-282."""
    rounded = int(x + 0.5)
    return rounded - rounded % RESO_STEPS


def select_bucket(width: int, height: int, resolution: int) -> Bucket:
    """BucketManager.select_bucket with no_upscale (train_util.py L308-346), at max_reso (R, R)."""
    if width <= 0 or height <= 0:
        raise NoBucket(f"size {width}x{height}")
    max_area = resolution * resolution
    aspect = width / height
    if width * height > max_area:
        resized_width = math.sqrt(max_area * aspect)
        resized_height = max_area / resized_width
        try:
            b_width = round_to_steps(resized_width)
            b_height_in_wr = round_to_steps(b_width / aspect)
            ar_width_rounded = b_width / b_height_in_wr
            b_height = round_to_steps(resized_height)
            b_width_in_hr = round_to_steps(b_height * aspect)
            ar_height_rounded = b_width_in_hr / b_height
        except ZeroDivisionError:
            raise NoBucket(f"{width}x{height} scaled to area {resolution}²") from None
        if abs(ar_width_rounded - aspect) < abs(ar_height_rounded - aspect):
            resized = (b_width, int(b_width / aspect + 0.5))
        else:
            resized = (int(b_height * aspect + 0.5), b_height)
    else:
        resized = (width, height)
    reso = (resized[0] - resized[0] % RESO_STEPS, resized[1] - resized[1] % RESO_STEPS)
    if 0 in reso:
        raise NoBucket(f"{width}x{height}: bucket {reso[0]}x{reso[1]}")
    return Bucket(reso, resized, reso[0] / reso[1] - aspect)


def pairwise_sum(values: list[float]) -> float:
    """numpy's pairwise summation of a contiguous float64 array, in its order of additions."""
    n = len(values)
    if n < 8:
        total = 0.0
        for v in values:
            total += v
        return total
    if n <= PAIRWISE_BLOCK:
        r = values[:8]
        i = 8
        while i < n - n % 8:
            r = [r[j] + values[i + j] for j in range(8)]
            i += 8
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for v in values[i:]:
            total += v
        return total
    half = n // 2
    half -= half % 8
    return pairwise_sum(values[:half]) + pairwise_sum(values[half:])


@dataclass(frozen=True)
class BucketTable:
    """The buckets sd-scripts will print: (resolution, count with repeats), sorted; and the mean aspect error."""

    buckets: tuple[tuple[tuple[int, int], int], ...]
    mean_ar_error: float | int

    def lines(self) -> list[str]:
        """The lines as sd-scripts logs them (train_util.py L1066 and L1074), message only."""
        rows = [f"bucket {i}: resolution ({w}, {h}), count: {n}" for i, ((w, h), n) in enumerate(self.buckets)]
        return [*rows, f"mean ar error (without repeats): {self.mean_ar_error}"]

    def as_dict(self) -> dict[str, object]:
        return {"buckets": [{"resolution": list(reso), "count": n} for reso, n in self.buckets],
                "mean_ar_error": self.mean_ar_error, "lines": self.lines()}


def bucket_table(buckets: list[Bucket], repeats: int) -> BucketTable:
    """The table of images already placed in their buckets (in sd-scripts' order: the images' names sorted)."""
    counts = Counter(b.resolution for b in buckets)
    rows = tuple((reso, counts[reso] * repeats) for reso in sorted(counts))
    errors = [abs(b.ar_error) for b in buckets]
    mean: float | int = pairwise_sum(errors) / len(errors) if errors else 0  # sd-scripts prints 0 for none (L1069)
    return BucketTable(rows, mean)
