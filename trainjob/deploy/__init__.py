"""Deploy: running ``trainjob run`` under a controller, locally or on Kubernetes.

Owns ``trainjob supervise`` (the pure relaunch policy in ``policy.py``, the child process in
``supervise.py``) and ``trainjob k8s render`` (``k8s.py``). Treats a run as a child process with an
exit-code contract and a log, and decides from those alone: must not touch the PVC, which the
child owns. Start with ``policy.py``.
"""
