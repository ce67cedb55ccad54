"""`python -m bench` (what `make bench` runs): every benchmark in turn, each printing its table.

Any argument (e.g. `--quick`) is passed to each of them. A benchmark that fails is reported and the others
still run; the exit status says whether all of them ran, never whether a target was met.
"""
from __future__ import annotations

import subprocess
import sys

BENCHES = ("stream", "status", "dispatch", "history", "memory", "eta_replay")


def main(argv: list[str]) -> int:
    failed = [name for name in BENCHES
              if subprocess.run([sys.executable, "-m", f"bench.{name}", *argv]).returncode != 0]
    if failed:
        print(f"benchmarks that did not run to the end: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
