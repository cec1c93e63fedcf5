"""Run a script (``python die_in_forward.py SCRIPT ARGS``) whose rank ``$DIE_RANK`` SIGKILLs itself
inside a forward: at the ``$DIE_AT_FORWARD``-th call of any module's forward (a global forward
pre-hook, which runs before FSDP's own pre-forward all-gather). The other ranks are left inside
the step's collectives, as when a node dies mid-step."""

import os
import runpy
import signal
import sys

import torch

calls = 0


def die_here(module, args):
    global calls
    calls += 1
    if calls == int(os.environ["DIE_AT_FORWARD"]) and os.environ.get("RANK") == os.environ["DIE_RANK"]:
        os.kill(os.getpid(), signal.SIGKILL)


torch.nn.modules.module.register_module_forward_pre_hook(die_here)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
