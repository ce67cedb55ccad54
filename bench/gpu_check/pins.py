"""What the GPU machine's image lacks for the real trainer, version by version, and how it travels.

The image (docs/benchmarks.md, "The first real GPU"): Python 3.12.3 (/opt/torch/.venv), torch 2.11.0+cu130,
accelerate 1.15.0, transformers 5.17.0, safetensors 0.8.0, huggingface_hub 1.33.0, tokenizers 0.23.2, numpy 2.5.2,
pillow, opencv-python-headless, einops, rich, tqdm, pyyaml, regex, requests, sentencepiece 0.2.2, psutil,
nvidia-ml-py; no diffusers, no bitsandbytes, perhaps no bubblewrap, and no network.

sd-scripts 48d368fa is run with the versions the CPU rig runs (../shared/rig: its requirements.txt, bitsandbytes
pinned to what the rig installed), which the worker's own tests and captures hold it to; the image's torch is the
one exception (2.11.0+cu130 there, 2.14.1 on the rig's CPU). Each wheel goes into the image's torch venv, over the
image's version where it has one (a machine lent for minutes and given back: nothing else runs there).
"""
from __future__ import annotations

SD_SCRIPTS_COMMIT = "48d368fa557731ad0488c07304dfeba8c07910eb"
PYTHON = "3.12"  # the image's; every wheel is fetched for it (cp312, manylinux x86_64)

# Part a travels in the first call (it alone is ~54 MB, with the ~5 MB tree under the 64 MiB a call carries).
PART_A: dict[str, str] = {
    "bitsandbytes": "0.50.2",  # AdamW8bit, the worker's optimizer; its wheel holds libbitsandbytes_cuda130.so (43 MB)
    "transformers": "4.54.1",  # sd-scripts' pin; the image's 5.x changed the CLIP model classes it builds
}
# Part b travels in the second call, with what else the check needs.
PART_B_TRAINER: dict[str, str] = {
    "diffusers": "0.32.1",  # sd-scripts' pin; not in the image
    "huggingface-hub": "0.34.3",  # transformers 4.54.1 needs < 1.0 (the image has 1.33.0)
    "tokenizers": "0.21.4",  # transformers 4.54.1 needs < 0.22 (the image has 0.23.2); the rig's version
    "accelerate": "1.6.0",  # sd-scripts' pin, and what the worker's resume rules were written against
    "safetensors": "0.4.5",  # sd-scripts' pin (the image has 0.8.0)
    "einops": "0.7.0",  # sd-scripts' pin
    "rich": "14.1.0",  # sd-scripts' pin
    "tqdm": "4.70.1",  # the rig's: the worker's parser reads its bar
    "toml": "0.10.2",  # sd-scripts' pin; not in the image
    "voluptuous": "0.15.2",  # sd-scripts' pin; not in the image
    "imagesize": "1.4.1",  # sd-scripts' pin; not in the image
}
# sd-scripts' requirements NOT carried, and why (none of them is imported by an SDXL LoRA run with AdamW8bit).
LEFT_OUT: dict[str, str] = {
    "opencv-python==4.10.0.84": "the image's opencv-python-headless gives the same cv2 (60 MB saved)",
    "ftfy, lion-pytorch, schedulefree, pytorch-optimizer, prodigy-plus-schedule-free, prodigyopt":
        "imported only for other optimizers or captioning",
    "tensorboard, sentencepiece, numpy, pillow": "the image's (sentencepiece 0.2.2 for 0.2.1: T5 only)",
    "torch==2.14.1 (the rig's)": "the image's 2.11.0+cu130: the CUDA build for its driver",
}
PIP = "25.3"  # bootstraps the worker's venv (`python3 -m venv --without-pip`: the image may lack ensurepip)
OPEN_CLIP = "2.20.0"  # its wheel holds bpe_simple_vocab_16e6.txt.gz, the CLIP tokenizers' source
