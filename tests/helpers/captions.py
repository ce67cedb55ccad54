"""Captions of every kind a CLIP tokenizer treats in its own way, drawn reproducibly: plain tags and sentences,
punctuation runs (`!` is bigG's pad token), contractions, numbers, accents, CJK, Cyrillic, Arabic, emoji with
joiners and flags, curly quotes, mojibake and HTML entities (ftfy mends them), ligatures and fullwidth letters,
odd whitespace, control characters, the special tokens' own text, and captions past 75 tokens."""
from __future__ import annotations

import gzip
import random
import shutil
from pathlib import Path

TAGS = ("a photo of ohwx woman portrait close-up smiling outdoors sunlight bokeh studio lighting wearing red dress "
        "standing in a field of flowers highly detailed 8k masterpiece best quality cinematic dramatic shadows "
        "looking at viewer long hair blonde brunette freckles city street night neon rain umbrella cat dog sitting "
        "on the grass beach sunset mountains snow forest river bridge car vintage film grain analog kodak portra "
        "400 35mm f/1.8 depth of field soft focus black and white monochrome watercolor oil painting sketch anime "
        "illustration 3d render octane unreal engine trending on artstation by greg rutkowski")
WORDS = tuple(TAGS.split(" "))
PUNCT = ("!", "!!", "!!!", "?!", "!?", "...", ",", ", ", ";", ":", "-", "—", "–", "(", ")", "[", "]", "{", "}", "'",
         '"', "/", "\\", "&", "#", "@", "%", "*", "+", "=", "<", ">", "|", "~", "^", "_", "``", "''")
PIECES = ("café", "naïve", "Zoë", "São Paulo", "Ångström", "façade", "Straße", "İstanbul", "ǅ", "東京の夜景",
          "漢字テスト", "한국어", "Москва ночью", "مرحبا بالعالم", "שלום", "ελληνικά", "हिन्दी", "ไทย",
          "👩‍👩‍👧", "🎉", "🇯🇵", "👍🏽", "❤️", "🔥🔥🔥", "😀!!", "“quoted”", "‘single’", "â€œmojibakeâ€\x9d",
          "Ã©tÃ©", "&amp;", "&lt;b&gt;", "&quot;hi&quot;", "&#39;", "ﬁne", "ﬂower", "ＡＢＣ", "１２３", "½", "²",
          "x\u00a0y", "tab\there", "zero\u200bwidth", "soft\u00adhyphen", "a\u3000b", "ctrl\x07char", "nul\x00byte",
          "del\x7f", "<|startoftext|>", "<|endoftext|>", "<|ENDOFTEXT|>", "it's", "they're", "we've", "I'm",
          "you'll", "he'd", "DON'T", "3.14159", "1,000,000", "2024-01-01", "v1.5", "SDXL", "LoRA", "ohwx_woman",
          "CamelCaseWord", "ALLCAPS", "e-mail", "https://example.com/a?b=c", "C++", "C#", "naïve—café…")


def caption(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        return ", ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 160)))  # past 75 tokens
    parts: list[str] = []
    for _ in range(rng.randint(1, 25)):
        roll = rng.random()
        if roll < 0.55:
            parts.append(rng.choice(WORDS))
        elif roll < 0.75:
            parts.append(rng.choice(PUNCT))
        else:
            parts.append(rng.choice(PIECES))
    glue = rng.choice([" ", " ", ", ", "", "  ", ",", " \t "])
    text = glue.join(parts)
    if rng.random() < 0.3:
        text = text.upper() if rng.random() < 0.5 else text.title()
    return text


def corpus(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    found = [caption(rng) for _ in range(n)]
    return [c for c in found if c.strip()]


CLIP_DATA = Path(__file__).resolve().parent.parent / "data" / "clip"


def clip_tokenizer_cache(root: Path) -> Path:
    """A --tokenizer_cache_dir of the two SDXL tokenizers with CLIP's real merges (tests/data/clip): what the caption
    count reads (the fakes' tokenizers are only shaped like CLIP's)."""
    from lora_worker.host.trainer import TOKENIZER_DIRS

    merges = gzip.decompress((CLIP_DATA / "merges.txt.gz").read_bytes())
    for name, config in zip(TOKENIZER_DIRS, ("clip_l", "bigg")):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "merges.txt").write_bytes(merges)
        shutil.copy(CLIP_DATA / f"{config}_tokenizer_config.json", folder / "tokenizer_config.json")
    return root
