"""The detached supervisor: one process per job, outliving the web service (see `launch` and `runner`)."""
