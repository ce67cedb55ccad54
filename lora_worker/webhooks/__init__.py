"""Webhooks: each job's events, delivered to arbo's endpoint, signed by the Standard Webhooks spec.

The events are rows of the ledger's outbox (ledger/outbox.py), written in the transaction of the change each
tells of, by whichever process makes it. One sender process delivers them (`python -m lora_worker.webhooks`,
process.py): under systemd its own unit, `lora-worker-webhooks.service`, and wherever that is missing (a
checkout, the demo) the web starts one when none runs. It is its own process because the web may be down
while a supervisor ends a job, and because a supervisor, next to the trainer for hours, must stay lean: it
writes the event with its row and carries no HTTP code. Nothing is kept in memory: a sender killed at any
point leaves every event in the outbox, and the next one sends what is not delivered (at least once, under
the same `webhook-id`).

  signing.py   the spec's headers, HMAC-SHA256 over `id.timestamp.body`, one signature per active secret; the
               secret file re-read when it changes
  delivery.py  one POST under one deadline, no redirects, at most 64 KiB of the answer read, Retry-After
  sender.py    the loop: per job in order, a few jobs at once, backoff with jitter, Retry-After, 410, give-up age
  process.py   the one sender (a lock), its start from the web (none under systemd), its signals
  lifeline.py  the process a sender dies with, where one is named (the demo)
"""
