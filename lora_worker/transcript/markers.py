"""The markers in sd-scripts' log lines: the lines that mean a phase, a save, the total, or a failure, and
where in a run of log lines one can begin (a superset, found with C-level searches).

The parser (transcript/parser.py) names each hit with MARKERS and applies it to the progress; the redraws of
the `steps` bar are transcript/redraws.py's.
"""
from __future__ import annotations

import re

from lora_worker.states import Phase

# Phase markers and the lines that decide an outcome, in one alternation so a chunk is scanned once.
# The trainer's text is data: it echoes paths, captions and train ids, which anyone who writes a dataset
# chooses. So a marker counts only as a whole line that sd-scripts itself writes: it must begin the line's
# message (see LINE_PREFIX: after nothing but a glued tqdm redraw, indentation or a rich logger's time and
# level), and the fixed messages must also end it (END: nothing after them but a rich logger's `file.py:NN`).
# Exceptions count as their traceback's own `Type: message` line, never as text quoted inside another one.
END = r"(?=[ \t]*(?:[\w.-]+\.py:\d+[ \t]*)?(?:[\r\n]|\Z))"
MARKERS = re.compile(
    r"(?P<loading_model>loading model for process \d+/\d+" + END +
    r"|load StableDiffusion checkpoint: |load Diffusers pretrained models)"
    r"|(?P<caching_latents>caching latents(?:\.\.\.| with caching strategy\.)" + END + ")"
    r"|(?P<caching_text_encoder_outputs>caching Text Encoder outputs(?:\.\.\.| with caching strategy\.)" + END + ")"
    r"|(?P<preparing_training>import network module: )"
    r"|(?P<saving>saving checkpoint: (?P<checkpoint>[^\r\n]*))"
    r"|(?P<state_saved>saving state at step (?P<state_step>\d+)" + END + ")"
    r"|(?P<last_state>saving last state\." + END + ")"
    r"|(?P<removed_checkpoint>removing old checkpoint: (?P<removed_path>[^\r\n]*))"
    r"|(?P<removed_state>removing old state: (?P<removed_state_path>[^\r\n]*))"
    r"|(?P<model_saved>model saved\." + END + ")"
    r"|(?P<sampling>generating sample images at step / サンプル画像生成 ステップ: (?P<sample_step>\d+)" + END + ")"
    r"|(?P<total>total optimization steps[^:\r\n]*: (?P<total_steps>\d+)" + END + ")"
    r"|(?P<no_data>No data found\. Please verify arguments)"
    r"|(?P<cuda_oom>(?:torch\.(?:cuda\.)?OutOfMemoryError|RuntimeError): CUDA (?:out of memory|error: out of memory"
    r"|error: CUBLAS_STATUS_ALLOC_FAILED))"
    r"|(?P<caption_invalid>AssertionError: caption file is empty|illegal char in file \(not UTF-8\))"
    r"|(?P<model_load_error>ValueError: The provided pretrained_model_name_or_path \"[^\r\n]*\" is neither a valid"
    r" local path nor a valid repo id|ValueError: model is not found as a file or in Hugging Face"
    r"|(?:[\w.]+\.)?(?:HFValidationError|OfflineModeIsEnabled): )"
    r"|(?P<tokenizer_missing>(?:[\w.]+: )?We couldn't connect to 'https://huggingface\.co'"
    r"|TypeError: expected str, bytes or os\.PathLike object, not NoneType)"
    r"|(?P<invalid_arguments>[\w.-]+: error: (?:unrecognized arguments|argument ))"
    r"|(?P<died>subprocess\.CalledProcessError: Command [^\r\n]* died with <Signals\.SIG[A-Z0-9]+: (?P<signum>\d+)>\."
    + END + ")"
    r"|(?P<inner_exit>subprocess\.CalledProcessError: Command [^\r\n]* returned non-zero exit status"
    r" (?P<inner_rc>\d+)\." + END + ")"
)
# What may stand before a marker on its line: a tqdm redraw the next line was glued onto (the streams share one
# pipe, and a redraw ends in no newline), indentation, and a rich logger's `2026-11-30 03:36:26 INFO     `.
LINE_PREFIX = re.compile(
    r"(?:(?:[^\r\n|]{0,64}\d+%\|[^|\r\n]*\|[^\[\r\n]*|\d+it )\[[^\]\r\n]*\])?[ \t]*"
    r"(?:(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[ \t]+)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]+)?"
)
# A marker where a line's message begins, matched there and nowhere else. It was searched for along the line and
# its prefix checked after: a branch's `[\w.]+` or `[^\r\n]*` then ran to the line's end from every position, and
# a 60 KB line of `torch.torch.…` took 134 s of the supervisor's loop (tests/transcript/test_parser_fuzz.py).
# Anchored, a line costs a few passes over it, whatever it holds.
LINE_MARKER = re.compile(LINE_PREFIX.pattern + "(?:" + MARKERS.pattern + ")")
PHASE_GROUPS = {p.value: p for p in (Phase.LOADING_MODEL, Phase.CACHING_LATENTS, Phase.CACHING_TEXT_ENCODER_OUTPUTS,
                                     Phase.PREPARING_TRAINING, Phase.SAMPLING, Phase.SAVING)}
# The saves a run announces (train_network.py save_model and remove_model, train_util.py's state savers): each
# is kept, in order, as a `Save` (transcript/parser.py), for transcript/checkpoints.py to record and verify.
SAVE_GROUPS = ("saving", "state_saved", "last_state", "removed_checkpoint", "removed_state")
FLAG_GROUPS = ("model_saved", "no_data", "cuda_oom", "caption_invalid", "model_load_error", "tokenizer_missing",
               "invalid_arguments", "died", "inner_exit")
# Where a marker can begin a message, found over a run of log lines in a few C-level passes instead of a regex
# scan of every character (a search of MARKERS is ~0.1 µs a character): each branch of MARKERS begins, at the start of
# the message, with one of MESSAGE_STARTS, or holds one of INNER_LITERALS (the branches that begin with a
# name). A message begins a line, or follows a glued redraw's `]`, after LINE_PREFIX's spaces, time and level.
# A hit is a candidate only, parsed again with MARKERS and LINE_PREFIX, so these may find more, never less
# (tests/transcript/test_stream.py walks MARKERS to keep it so).
MESSAGE_STARTS = (
    "loading model for process ", "load StableDiffusion checkpoint: ", "load Diffusers pretrained models",
    "caching latents", "caching Text Encoder outputs", "import network module: ", "saving checkpoint: ",
    "saving state at step ", "saving last state.", "removing old checkpoint: ", "removing old state: ",
    "model saved.", "generating sample images at step", "total optimization steps",
    "No data found. Please verify arguments", "torch.",
    "RuntimeError: CUDA ", "AssertionError: caption file is empty", "illegal char in file (not UTF-8)",
    "ValueError: ", "TypeError: expected str", "subprocess.CalledProcessError: Command ",
)
INNER_LITERALS = (b"HFValidationError: ", b"OfflineModeIsEnabled: ", b"We couldn't connect to 'https://huggingface",
                  b": error: ")


def _message_pattern() -> bytes:
    """`[ \\t]*` and then a message start, bare or after a rich logger's time and level, as one alternation whose
    every branch begins with a different character: the engine tries one branch per character, without entering
    nested groups."""
    starts: dict[bytes, list[bytes]] = {}
    for literal in MESSAGE_STARTS:
        starts.setdefault(re.escape(literal[0].encode()), []).append(re.escape(literal[1:].encode()))
    message = b"(?:" + b"|".join(first + b"(?:" + b"|".join(rest) + b")" for first, rest in starts.items()) + b")"
    branches = [first + b"(?:" + b"|".join(rest) + b")" for first, rest in starts.items()]
    levels = (b"DEBUG", b"INFO", b"WARNING", b"ERROR", b"CRITICAL")  # none begins as a message start does
    branches += [level + rb"[ \t]+" + message for level in levels]
    branches.append(rb"\d\d\d\d-\d\d-\d\d \d\d:\d\d:\d\d[ \t]+(?:" + b"|".join(levels) + rb")[ \t]+" + message)
    # The characters the branches begin with, looked at first: most lines begin otherwise, and are rejected
    # with one class test instead of one test per branch.
    first = b"[" + b"".join(starts) + b"".join(level[:1] for level in levels) + rb"\d]"
    return rb"[ \t]*(?=" + first + rb")(?:" + b"|".join(branches) + b")"


_MESSAGE = _message_pattern()
AT_LINE_START = re.compile(_MESSAGE)
AFTER_NEWLINE = re.compile(rb"\n" + _MESSAGE)  # a literal first: the engine skips to each \n in C
AFTER_BAR = re.compile(rb"\]" + _MESSAGE)
# A short run of log lines (an epoch line between two runs of redraws) is looked at with one search for all of
# the above; a long one with a search each, each of which skips to its first character in C.
SMALL_RUN = 2048
SMALL_RUN_CANDIDATE = re.compile(AFTER_NEWLINE.pattern + b"|" + AFTER_BAR.pattern + b"|"
                                 + b"|".join(re.escape(literal) for literal in INNER_LITERALS))
# Every string MARKERS matches holds one of these characters, and a redraw of the `steps` bar none: a run of
# redraws without them cannot hold a marker (tests/transcript/test_parser.py walks MARKERS to keep this true). Looking
# for them is a memchr each.
MARKER_GUARD = "cdmg"
MARKER_GUARD_BYTES = tuple(c.encode() for c in MARKER_GUARD)


def message_starts(data: bytes, lo: int, hi: int) -> list[int]:
    """The starts of the log lines in data[lo:hi] (no \\r there, each ends in \\n) where a marker can begin
    the message, in order: a superset of where MARKERS can count, found with C-level searches."""
    if hi - lo <= SMALL_RUN and not AT_LINE_START.match(data, lo):
        if (first := SMALL_RUN_CANDIDATE.search(data, lo, hi)) is None:
            return []
        lo = line_start(data, first.start(), lo)  # the lines before the first hit hold none
    starts: set[int] = set()
    if AT_LINE_START.match(data, lo):
        starts.add(lo)
    for pattern in (AFTER_NEWLINE, AFTER_BAR):
        starts.update(line_start(data, m.start(), lo) for m in pattern.finditer(data, lo, hi))
    for literal in INNER_LITERALS:
        at = data.find(literal, lo, hi)
        while at >= 0:
            starts.add(line_start(data, at, lo))
            at = data.find(literal, data.find(b"\n", at, hi), hi)
    return sorted(s for s in starts if s < hi)



def line_start(data: bytes, pos: int, lo: int) -> int:
    """The start of the line holding `pos`, or of the line after it when `pos` is a line's \n."""
    if data[pos] == 10:
        return pos + 1
    return data.rfind(b"\n", lo, pos) + 1 or lo



def line_end(text: str, pos: int) -> int:
    """Where the line (or the redraw segment) holding `pos` ends."""
    ends = [e for e in (text.find("\n", pos), text.find("\r", pos)) if e >= 0]
    return min(ends) if ends else len(text)

