"""Storage: every byte trainjob keeps on the PVC, and how it gets there durably.

Owns the atomic writers (tmp file, fsync, rename, fsync the directory; a staged directory
committed by one rename), the locks, the PVC's small files (state, attempts, pointer, artifacts),
the decision log's appends and reads, and hashing while writing. Must not decide anything: what to
write, when, and what a file means belong to the parts above. Start with ``backend.py`` (the one
interface every store implements), then ``pvc.py`` (a directory: ``LocalBackend``, and ``Pvc``,
the PVC's files over any backend) and ``s3.py`` (a bucket, by conditional writes).
"""
