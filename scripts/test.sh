#!/usr/bin/env bash
# Set up a virtualenv with the test extras and run the whole suite in four named steps: pytest
# (both tiers, on every core, with the 15 slowest tests listed), the lab checks, the
# reliability campaign at CI size, and the issues' acceptance runs. Every step runs; the last
# lines name each step's verdict, so a red campaign names itself. Arguments go to pytest. CONTRIBUTING.md says what to run when.
set -euo pipefail
cd "$(dirname "$0")/.."

# libfiu's fiu-run injects real I/O faults for the campaign; install it where we can.
if ! command -v fiu-run >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q fiu-utils >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fiu-utils >/dev/null 2>&1; } \
        || echo "note: could not install fiu-utils; the I/O-fault section will be skipped"
fi

# The SVG/PNG diagram tests need Graphviz's `dot`, and the replay page's test a headless Chromium
# with its driver (Debian's chromium, chromium-driver). Install them where we may (CI runs as root
# with apt); elsewhere those tests skip, except under CI=true, where a missing one fails them.
missing=()
command -v dot >/dev/null || missing+=(graphviz)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing ${missing[*]} for the diagram and replay tests" >&2
    apt_log=$(mktemp)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$apt_log" 2>&1; then
        cat "$apt_log" >&2
        echo "test.sh: could not install ${missing[*]}${CI:+ (CI needs them)}" >&2
        [ -z "${CI:-}" ] || exit 1
    fi
    rm -f "$apt_log"
fi
# The `slurm` tests submit rendered scripts to a one-node loopback Slurm cluster (scripts/slurm.sh
# starts it inside the tests); install slurm-wlm and munge where we may. Elsewhere those tests skip,
# except under CI=true, where they fail.
if ! command -v slurmctld >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing slurm-wlm and munge for the slurm tests" >&2
    bash scripts/slurm.sh install || { echo "test.sh: could not install Slurm${CI:+ (CI needs it)}" >&2; [ -z "${CI:-}" ] || exit 1; }
fi
python3 -m venv .venv
# The torch tests (tests/trainers/test_torch.py, examples/finetune.py's) need torch. This exact pin is
# the CPU wheel CI has on local disk (any other version downloads gigabytes); where it cannot be
# installed those tests skip with the reason, except under CI=true, where a missing torch fails the
# run. It goes in first: the test extra's torchdata requires some torch, and pip then keeps this one.
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0' \
        || { echo "test.sh: could not install torch==2.13.0${CI:+ (CI needs it)}" >&2; [ -z "${CI:-}" ] || exit 1; }
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

failed=()
step() {  # step NAME COMMAND...: run it, say how it ended, remember a failure
    local name=$1; shift
    echo "== test.sh: $name ==" >&2
    local start=$SECONDS
    if "$@"; then
        echo "== test.sh: $name passed ($((SECONDS - start)) s) ==" >&2
    else
        echo "== test.sh: $name FAILED (exit $?, $((SECONDS - start)) s) ==" >&2
        failed+=("$name")
    fi
}
# One pytest worker more than there are cores: a process test spends part of its time waiting (an
# fsync, a peer's --rank-timeout, a poll for the next checkpoint), and the extra worker fills it.
# worksteal: a worker that runs dry takes tests queued on another, so no long test waits at the end
# of a queue. On this 2-core machine: 9m16s with -n auto (load), 7m18s with -n 3 --dist worksteal.
workers=$(( $(nproc) + 1 ))
step "pytest" .venv/bin/python -m pytest -n "$workers" --dist worksteal --durations=15 -m "not acceptance" "$@"
step "lab checks" bash scripts/check.sh
step "chaos campaign" .venv/bin/python scripts/chaos.py
# The examples the issues were accepted on (vision, the HF Trainer and Lightning integrations:
# killed, SIGTERMed, proven at W=1 and W=2), and the default suite's slowest whole-launch
# tests, 20 s or more each (CONTRIBUTING.md): minutes of them, so the default suite above stays fast.
# Arguments that select no acceptance test (a file, a -k) leave it nothing to do: pytest's 5.
acceptance() { .venv/bin/python -m pytest -n "$workers" --dist worksteal --durations=10 -m acceptance "$@" || [ $? = 5 ]; }
step "acceptance" acceptance "$@"
if [ ${#failed[@]} -gt 0 ]; then
    echo "test.sh: failed: ${failed[*]}" >&2
    exit 1
fi
echo "test.sh: pytest, lab checks, chaos campaign and acceptance all passed" >&2
