"""What the dataset checks find, file by file: the one catalogue of finding codes (docs/errors.md's "Dataset findings"
table holds it word for word, a test).

An error is what would crash the trainer, or what it would silently train to nothing: a request with one is a 422
`dataset_invalid` whose `details.findings` lists every finding. A warning is what the trainer would train through,
but not as the user may think: it is in a dry run's plan, in a real POST's 202 (`warnings`), and with the job
(`GET /train/<id>`, `lora-worker jobs show`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]

# code → (severity, what it means). The limits named here are dispatch/lint.py's.
FINDINGS: dict[str, tuple[Severity, str]] = {
    "no_images": ("error", "The kohya folder holds no image sd-scripts reads: it would log `No data found` and exit 0 "
                           "without a LoRA."),
    "too_many_images": ("error", "The folder holds more images than a dataset may (1000)."),
    "dataset_too_large": ("error", "The images together are larger than a dataset may be (4 GiB)."),
    "image_not_regular": ("error", "The image is a link, a FIFO or a device, not a regular file in the dataset."),
    "image_unreadable": ("error", "The image cannot be opened or read."),
    "image_name_not_utf8": ("error", "The image's file name is not UTF-8: sd-scripts would train on it, but no "
                                     "record or answer can hold its name as it is."),
    "image_empty": ("error", "The image file is empty."),
    "image_format": ("error", "The file's content is none of PNG, JPEG, WebP, BMP."),
    "image_too_large": ("error", "The image file is larger than an image may be (64 MiB)."),
    "image_size_unreadable": ("error", "Pillow cannot open the image or read its size: sd-scripts takes it as 0x0 "
                                       "and divides by zero when it makes the buckets, or (where its `imagesize` "
                                       "reads the header) dies at `caching latents`."),
    "image_undecodable": ("error", "Pillow cannot decode the whole image (truncated or corrupt): the trainer would "
                                   "die at `caching latents`, after loading the model."),
    "image_too_many_pixels": ("error", "More pixels than the trainer's Pillow opens (178,956,970): it would die "
                                       "at `caching latents` (DecompressionBombError)."),
    "image_edge_under_64": ("error", "An edge of the image, at the size sd-scripts trains it, is under 64 px: its "
                                     "bucket would be 0 px wide or high, and sd-scripts divides by zero on it."),
    "caption_not_regular": ("error", "The caption is a link, a FIFO or a device, not a regular file in the dataset."),
    "caption_unreadable": ("error", "The caption file cannot be opened or read."),
    "caption_too_large": ("error", "The caption file is larger than 64 KiB."),
    "caption_not_utf8": ("error", "The caption is not UTF-8: sd-scripts raises on it while it reads the captions."),
    "caption_empty": ("error", "The caption's first line is empty: sd-scripts asserts on an empty file, and trains "
                               "on nothing for an empty first line."),
    "image_small": ("warning", "The image has fewer than half the pixels of the tier's resolution squared: under "
                               "--bucket_no_upscale it trains at its own size (the message names its bucket)."),
    "image_not_verified": ("warning", "The image has more pixels than the check decodes (89,478,485): its size was "
                                      "read from its header, its content not decoded."),
    "image_duplicate": ("warning", "The image's bytes are the same as another's (sha256): it trains twice as often."),
    "caption_missing": ("warning", "The image has no caption file: sd-scripts captions it with the folder's class "
                                   "tokens (`<trigger> <subject_class>`)."),
    "caption_truncated": ("warning", "The caption is longer than the 75 CLIP tokens the text encoders read: "
                                     "sd-scripts drops the rest without a word."),
    "caption_shared": ("warning", "Two images read one caption file (the same stem, e.g. a.jpg and a.png)."),
    "file_skipped": ("warning", "An image file sd-scripts' glob passes over without a word (a dot-file, an extension "
                                "in mixed case, or a format it does not read): it is not trained on."),
}


@dataclass(frozen=True)
class Finding:
    """One finding about one file (`file`: its path inside the dataset, e.g. `10_ohwx woman/a.png`)."""

    code: str
    file: str
    message: str

    def __post_init__(self) -> None:
        if self.code not in FINDINGS:
            raise ValueError(f"unknown finding code {self.code!r}")

    @property
    def severity(self) -> Severity:
        return FINDINGS[self.code][0]

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "severity": self.severity, "file": self.file, "message": self.message}
