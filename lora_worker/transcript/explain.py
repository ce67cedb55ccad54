"""Why the trainer failed, read from the last lines of its output: the line that explains it, and its class. Pure.

sd-scripts dies with a Python traceback on stderr; the launcher (`accelerate launch`) then adds a traceback of
its own ending in `subprocess.CalledProcessError: Command '[<the whole argv>]' returned non-zero exit status 1.`
That line says nothing the exit status does not, and its argv fills any message it is quoted in. So:
- the explaining line is the exception line of the trainer's last traceback (its chain included), never the
  launcher's; without a traceback, one of the few whole lines sd-scripts prints before exiting on its own;
- the class comes from that traceback's structure, matched on whole lines only: its exception line from the
  start, and the functions its frames name (`  File "…", line N, in read_caption`). Text that merely contains
  a marker (a caption, a dataset path, a train id) cannot move it: it is never at the start of an exception
  line of the final traceback, nor a frame;
- the log lines quoted after it leave the launcher's traceback out and shorten the very long lines (sd-scripts
  prints a 90 KB list of missing keys on one line).

Every rule comes from a real run: tests/data/*.jsonl, tests/data/*.log, or the failure table of
docs/reference/sd-scripts-failures.md, and tests/transcript/test_outcome.py replays each.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lora_worker.states import FailureClass

TRACEBACK = "Traceback (most recent call last):"
# Python prints these between the tracebacks of one chain of exceptions.
CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")
FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+, in (?P<func>\S+)$')
LAUNCHER_EXCEPTION = "subprocess.CalledProcessError: "
MAX_LINE_CHARS = 500  # a quoted log line longer than this is shortened (head kept: it says what the line is)
MAX_EXPLAINING_CHARS = 800  # room left in a one-line sentence for what the worker makes of it


@dataclass(frozen=True)
class Traceback:
    frames: tuple[tuple[str, str], ...]  # (path, function), outermost first
    exception: str  # the exception line, e.g. "AssertionError: caption file is empty / …: …/img2.txt"
    detail: tuple[str, ...] = ()  # indented lines after it (the state_dict errors' "\tMissing key(s) …")
    first_line: int = 0
    last_line: int = 0

    @property
    def functions(self) -> frozenset[str]:
        return frozenset(func for _, func in self.frames)

    @property
    def files(self) -> frozenset[str]:
        return frozenset(path.rsplit("/", 1)[-1] for path, _ in self.frames)

    @property
    def is_launchers(self) -> bool:
        return self.exception.startswith(LAUNCHER_EXCEPTION)


@dataclass(frozen=True)
class Rule:
    failure: FailureClass
    summary: str  # the worker's reading of it, a sentence without its full stop
    exception: re.Pattern[str] | None = None  # matched at the start of the exception line
    functions: frozenset[str] = frozenset()  # or: a frame in one of these functions …
    files: tuple[str, ...] = ()  # … or in a file whose name starts with one of these

    def matches(self, tb: Traceback) -> bool:
        if tb.exception.startswith("KeyboardInterrupt"):
            return False  # SIGINT, wherever it landed: the signal is the cause, not the code it interrupted
        if self.exception is not None and not self.exception.match(tb.exception):
            return False
        if self.functions or self.files:
            return bool(self.functions & tb.functions) or any(f.startswith(self.files) for f in tb.files)
        return True


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


# Strongest evidence first: an OOM explains a crash better than where it happened does.
RULES = (
    # torch >= 2.5 names it torch.OutOfMemoryError, older torch torch.cuda.OutOfMemoryError or a RuntimeError
    Rule(FailureClass.CUDA_OOM, "The GPU ran out of memory",
         _rx(r"(?:torch\.(?:cuda\.)?OutOfMemoryError|RuntimeError): (?:CUDA out of memory|CUDA error: out of memory)"
             r"|RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED")),
    # transformers offline with no tokenizer files: vocab_file is None (fail_no_tokenizer_offline in
    # docs/reference/sd-scripts-failures.md)
    Rule(FailureClass.TOKENIZER_MISSING,
         "The CLIP tokenizers could not be loaded offline: their files are missing from the tokenizer cache",
         _rx(r"TypeError: expected str, bytes or os\.PathLike object, not NoneType"),
         frozenset({"_load_tokenizer", "from_pretrained"}), ("tokenization_",)),
    # fail_tokenizer_hollow.log: OverflowError padding to a max_length of 10^30, while caching TE outputs
    Rule(FailureClass.TOKENIZER_INVALID,
         "The CLIP tokenizers are broken: check vocab.json, merges.txt and tokenizer_config.json in the "
         "tokenizer cache", None, frozenset({"_load_tokenizer", "tokenize", "_get_input_ids"}), ("tokenization_",)),
    # fail_model_missing_keys.log, fail_missing_model.jsonl, and the repo-id/offline case of the failure table
    Rule(FailureClass.MODEL_LOAD_ERROR, "sd-scripts could not load the base model", None,
         frozenset({"load_target_model", "_load_target_model", "load_models_from_sdxl_checkpoint"})),
    Rule(FailureClass.MODEL_LOAD_ERROR, "sd-scripts could not load the base model",
         _rx(r"RuntimeError: Error\(s\) in loading state_dict for |huggingface_hub\.errors\.OfflineModeIsEnabled: "
             r"|OSError: Cannot load model ")),
    # fail_empty_caption.jsonl; a non-UTF-8 caption raises UnicodeDecodeError in the same function
    Rule(FailureClass.DATASET_INVALID, "A caption file is empty or not UTF-8", None,
         frozenset({"read_caption"})),
    # the failure table's fail_te_cache_combo: an argument combination sd-scripts' own checks refuse
    Rule(FailureClass.INVALID_ARGUMENTS, "sd-scripts refused its arguments",
         _rx(r"AssertionError: network for Text Encoder cannot be trained with caching Text Encoder outputs")),
)
# Whole lines sd-scripts (or argparse) prints when it stops without a traceback of its own.
LINE_RULES = (
    (_rx(r"No data found\. Please verify arguments \(train_data_dir must be the parent of folders with images\)"),
     FailureClass.DATASET_INVALID, "sd-scripts found no training images (No data found)"),
    # argparse: `sdxl_train_network.py: error: unrecognized arguments: --text_encoder_lr1=1e-5` (exit 2 inside)
    (_rx(r"[\w.-]+\.py: error: "), FailureClass.INVALID_ARGUMENTS, "sd-scripts refused its arguments"),
)


# The supervisor's own reasons to stop a run, said the same way on every backend.
def signalled_summary(signal_name: str) -> str:
    return (f"The supervisor received {signal_name}, which was no client's cancel (a shutdown or reboot, "
            "`systemctl kill`, an operator); it stopped every process of the job. A new try may pass")


def nan_loss_summary(step: int) -> str:
    return (f"The loss became NaN at step {step}: the run could learn nothing more, so the supervisor stopped it "
            "(SIGTERM, a grace, then SIGKILL, as a cancel). Retry with another seed or dataset")


@dataclass(frozen=True)
class Explanation:
    """The line that explains a failure, in full, and what the worker makes of it."""

    line: str
    failure: FailureClass | None = None  # None: a crash of no known kind (still named by its line)
    summary: str | None = None


def explain(lines: list[str]) -> Explanation | None:
    """The explanation of a failed run from its last output lines (\\r redraws collapsed), or None."""
    blocks = tracebacks(lines)
    chain = final_chain(blocks, lines)
    if chain:
        for rule in RULES:
            for tb in reversed(chain):
                if rule.matches(tb):
                    return Explanation(explaining_line(tb), rule.failure, rule.summary)
        return Explanation(explaining_line(chain[-1]))
    for line in reversed(lines):
        for pattern, failure, summary in LINE_RULES:
            if pattern.match(line):
                return Explanation(_shorten(line, MAX_EXPLAINING_CHARS), failure, summary)
    return None


def tracebacks(lines: list[str]) -> list[Traceback]:
    """Every traceback in `lines`, in order. A traceback may start glued to a bar redraw (`…]Traceback …`):
    the redraw has no newline of its own (docs/reference/sd-scripts-failures.md, fail_bad_output_dir)."""
    found = []
    i = 0
    while i < len(lines):
        if not lines[i].endswith(TRACEBACK):
            i += 1
            continue
        start, frames = i, []
        i += 1
        while i < len(lines) and lines[i].startswith(" "):
            if m := FRAME.match(lines[i]):
                frames.append((m["path"], m["func"]))
            i += 1
        if i >= len(lines):
            break  # cut off before its exception line: no evidence
        exception, detail = lines[i], []
        i += 1
        while i < len(lines) and lines[i][:1] in ("\t", " ") and not FRAME.match(lines[i]):
            detail.append(lines[i])
            i += 1
        found.append(Traceback(tuple(frames), exception, tuple(detail), start, i - 1))
    return found


def final_chain(blocks: list[Traceback], lines: list[str]) -> list[Traceback]:
    """The trainer's last exception with the ones it was raised while handling: tracebacks printed back to back,
    joined only by Python's chain lines. An earlier, unrelated traceback-shaped text is not evidence."""
    trainer = [tb for tb in blocks if not tb.is_launchers]
    if not trainer:
        return []
    chain = [trainer[-1]]
    for tb in reversed(trainer[:-1]):
        between = [line for line in lines[tb.last_line + 1:chain[0].first_line] if line.strip()]
        if not all(line in CHAIN_LINES for line in between):
            break
        chain.insert(0, tb)
    return chain


def explaining_line(tb: Traceback) -> str:
    """The exception line in full, on one line with its indented detail (shortened: a key list is counted)."""
    parts = [tb.exception.rstrip()] + [_detail(line).strip() for line in tb.detail]
    return _shorten(" ".join(parts), MAX_EXPLAINING_CHARS)


def quotable(lines: list[str]) -> list[str]:
    """The log lines an error may quote: no launcher traceback (its argv dump), long lines shortened."""
    skip: set[int] = set()
    for tb in tracebacks(lines):
        if tb.is_launchers:
            skip.update(range(tb.first_line, tb.last_line + 1))
    return [_shorten(line, MAX_LINE_CHARS) for i, line in enumerate(lines) if i not in skip and line.strip()]


KEY_LIST = re.compile(r'^(?P<what>\s*(?:Missing|Unexpected) key\(s\) in state_dict: )(?P<keys>".*)$')


def _detail(line: str) -> str:
    m = KEY_LIST.match(line)
    if not m:
        return _shorten(line, MAX_LINE_CHARS)
    keys = m["keys"].rstrip(". ").split(", ")
    shown = ", ".join(keys[:3])
    return f"{m['what']}{shown}{', …' if len(keys) > 3 else ''} ({len(keys)} keys)"


def _shorten(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit - 40]}… ({len(line)} characters)"
