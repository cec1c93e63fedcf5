#!/usr/bin/env bash
# Set up a virtualenv and run the lab's walkthrough on the embedded data: generate it,
# kill the job at step 4, relaunch it (it resumes to model-v1), then read the status.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e . || exit 1
out=${1:-out}
pvc=$out/pvc
rm -rf "$out"

step() {  # run one trainjob command, show it and its exit code
    echo "\$ trainjob $*"
    .venv/bin/trainjob "$@"
    echo "exit=$?"
}
step gen "$out/data"
step run --pvc "$pvc" --data "$out/data" --die-at 4 --steps 10
step run --pvc "$pvc" --data "$out/data"
step status "$pvc/log.jsonl"
echo "--- $pvc/log.jsonl"
cat "$pvc/log.jsonl"
