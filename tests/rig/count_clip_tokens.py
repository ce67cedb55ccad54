"""Run with the RIG's python (its transformers, ftfy and regex): each caption of the JSON list on stdin, counted by
sd-scripts' own SDXL tokenizers (library/strategy_sdxl.py SdxlTokenizeStrategy, loaded from the rig's
--tokenizer_cache_dir as the trainer loads them), untruncated, BOS and EOS left out. Prints a JSON list of
[clip_l, bigg] counts. Usage: <rig>/venv/bin/python count_clip_tokens.py <rig> < captions.json
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    rig = sys.argv[1]
    sys.path.insert(0, f"{rig}/sd-scripts")
    from library.strategy_sdxl import SdxlTokenizeStrategy

    strategy = SdxlTokenizeStrategy(None, f"{rig}/tokenizers")
    captions = json.load(sys.stdin)
    counts = [[len(t(c).input_ids) - 2 for t in (strategy.tokenizer1, strategy.tokenizer2)] for c in captions]
    sys.stdout.write(json.dumps(counts))


if __name__ == "__main__":
    main()
