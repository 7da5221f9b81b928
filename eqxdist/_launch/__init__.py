"""The local multi-process launcher behind `python -m eqxdist.launch`: the command
line and restarts (`cli`), one attempt at the job (`job`), the coordinator port
(`ports`), the per-process wrapper (`child`, run by path) and the watchdog process
(`watchdog`, run by path). Standard library only."""
