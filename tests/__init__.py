# The per-check timeout (seconds) of the multi-rank tests that take tens of seconds when two
# cores run four ranks: long enough for a loaded machine, short enough to report a real hang.
HEAVY = 180.0
