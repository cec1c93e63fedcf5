"""Deploy: running ``trainjob run`` under a controller, locally, on Kubernetes or on Slurm.

Owns ``trainjob supervise`` (the pure relaunch policy in ``policy.py``, the child process in
``supervise.py``), ``trainjob k8s render`` (``k8s.py``), ``trainjob slurm render`` (``slurm.py``,
whose script asks ``policy.after_launch`` what each launch's code makes the job do) and ``trainjob prove`` (``prove.py``, on
``launches.py``: a launch started in its own session and killed whole, which the chaos campaign
uses too; ``divergence.py`` reads two runs' PVCs, ``hints.py`` decides, purely, which piece of the
state did not resume). Treats a run as a child process with an exit-code contract and a log, and decides from
those alone: must not write the PVC, which the child owns (prove only reads the PVCs it made for
its runs). Start with ``policy.py``.
"""
