"""Request and response shapes, a module per route group: job.py (POST /train, GET /train/<id>, cancel,
the list), log.py (the log and the progress series), gpu.py (/gpu and /healthz), errors.py (every error), and
common.py (the field kinds they share). Load schemas refuse anything unknown; dump schemas say exactly what
goes out."""
