"""`python -m lora_worker.webhooks [--ready-fd=N | --foreground]`: become the worker's webhook sender
(process.py says what it is). Forked off as the Slurm poller is (host/detach.py), or, with `--foreground`
(its systemd unit), run in place.
"""
from __future__ import annotations

import os
import sys

from lora_worker.host.detach import detached_main

USAGE = "usage: python -m lora_worker.webhooks [--ready-fd=N | --foreground]"


def main(argv: list[str]) -> int:
    if argv == ["--foreground"]:
        from lora_worker.webhooks.process import serve

        _unread, ready_w = os.pipe()  # nobody reads the handshake (systemd watches the process); kept open
        return serve(ready_w)
    return detached_main(argv, USAGE, "lora_worker.webhooks.process")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
