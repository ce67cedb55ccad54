"""The detached supervisor: one process per job, outliving the web service. `backend` is how the rest of the
worker starts and asks after runs (`local` is today's backend); `__main__` and `main` are the supervisor's
entry; `runner` composes the run loop from `reader`, `reporter`, `watchdog`, `requests` and `stopper` over
the `seam` to the OS, and `outcome` decides how the run ended."""
