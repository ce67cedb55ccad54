"""What sd-scripts' output means, for every process that follows a run: the local supervisor, the Slurm poller,
and the operator's CLI. Pure reading and deciding (parser, explain, output, logfile, eta, outcome, watchdog):
nothing here starts, signals or waits on a process."""
