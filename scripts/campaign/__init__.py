"""The reliability campaign's parts (``scripts/chaos.py`` is its command line and summary table).

    harness.py   the runs: commands, the uninterrupted references, a trial's recovery and its checks
    signals.py   kill storm (SIGKILL at random instants, and the instant `completed` is logged), SIGTERM storm
    faults.py    libfiu I/O faults, shard read faults (W=1, W=2, an FSDP verdict round), a full disk
    inputs.py    hostile inputs: corrupted bytes, special files, absurd manifests, hostile log lines,
                 forged manifests
    races.py     runs started at once on one PVC, reshards beside a run, reshards killed
    bucket.py    S3: the bucket's server SIGKILLed, SIGTERMed or SIGSTOPped during saves and loads
    security.py  no evaluation of stored data, no loose file modes, no forged log lines, no symlink escape

Every section is a function of a ``Campaign`` returning a ``Section``: trials, faults delivered and
violations, each violation naming its trial so the seeded run can be replayed.
"""
