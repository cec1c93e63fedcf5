"""Fork many times from several threads while native threads keep making thread states.

    python fork_from_threads.py bare|guard FORKS_PER_THREAD

A Python thread starts native threads one after another (``pthread_create``, then ``pthread_join``),
each running a ctypes callback; each call makes a thread state, taking the interpreter's
thread-list lock without the GIL, which is how a C++ thread calling into Python takes it. Meanwhile three Python threads
each fork FORKS_PER_THREAD children through ``os.fork()`` that exit at once, and Python threads
start and end. ``guard`` first installs trainjob/trainers/torch/forking.py (from its file).
Prints one JSON line: the children that exited and those still inside fork() after 5 s (killed).
"""

import ctypes
import gc
import json
import os
import sys
import threading
import time

from forking_alone import forking

if sys.argv[1] == "guard":
    assert forking.install(), "the fork handler was not installed"
per_thread = int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)


calls = [0]
callback = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda _: calls.__setitem__(0, calls[0] + 1))
done = threading.Event()


def native_threads() -> None:  # one at a time: each makes a fresh thread state and deletes it
    while not done.is_set():
        thread = ctypes.c_ulong()
        assert libc.pthread_create(ctypes.byref(thread), None, callback, None) == 0
        libc.pthread_join(thread, None)


children: list[int] = []


def fork_many() -> None:
    for _ in range(per_thread):
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 3)  # collection is back on in the child
        children.append(pid)


def churn() -> None:  # Python threads starting and ending: thread states made and deleted under the GIL
    while not done.is_set():
        threading.Thread(target=lambda: None).start()
        time.sleep(0.001)


busy = [threading.Thread(target=churn), threading.Thread(target=native_threads)]
for t in busy:
    t.start()
forkers = [threading.Thread(target=fork_many) for _ in range(3)]
for t in forkers:
    t.start()
for t in forkers:
    t.join()
done.set()
for t in busy:
    t.join()
assert gc.isenabled(), "collection was left off in the parent"
exited, stuck, deadline = 0, 0, time.monotonic() + 5
for pid in children:
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0, status
            exited += 1
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            stuck += 1
            break
        time.sleep(0.01)
print(json.dumps({"exited": exited, "stuck": stuck, "callbacks": calls[0]}))
