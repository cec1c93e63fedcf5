"""Storage: every byte trainjob keeps on the PVC, and how it gets there durably.

Owns the atomic writers (tmp file, fsync, rename, fsync the directory; a staged directory
committed by one rename), the locks, the PVC's small files (state, attempts, pointer, artifacts),
the decision log's appends and reads, and hashing while writing. Must not decide anything: what to
write, when, and what a file means belong to the parts above.

Each room holds one thing. Start with ``backend.py`` (the one interface every store implements),
then ``pvc.py`` (``Pvc``: the PVC's files over any backend, and ``open_backend``). A directory is
``local.py`` (``LocalBackend``), built from ``durable.py`` (atomic and staged writes, fsync,
writeback), ``locks.py`` (the PVC's locks and who holds them) and ``deletion.py`` (a directory
hidden by one rename, freed later); a bucket is ``s3.py`` (conditional writes). ``eventlog.py``
is the decision log, ``digest.py`` hashing while writing.
"""
