#!/usr/bin/env bash
# The lab's nine checks, one `RESULT name PASS|FAIL` line each; exits 1 if any check fails.
#
#   bash scripts/check.sh                     checks the installed trainjob (.venv)
#   TRAINJOB="python scripts/starter.py" ...  checks the lab's starter stubs instead (4 FAILs)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TRAINJOB=${TRAINJOB:-"$root/.venv/bin/trainjob"}
PY=${PY:-"$root/.venv/bin/python"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
failures=0

tj() { $TRAINJOB "$@" 2>>"$work/stderr"; }
result() {  # result NAME CONDITION-EXIT-CODE
    if [ "$2" -eq 0 ]; then echo "RESULT $1 PASS"; else echo "RESULT $1 FAIL"; failures=$((failures + 1)); fi
}
count() { grep -c "\"event\":\"$1\"" "$2" 2>/dev/null || true; }
json_get() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2" 2>/dev/null; }

# 1. build: the program starts and knows its version
tj --version >/dev/null
result build $?

# 2. gen_is_repeatable: same seed, same bytes
tj gen g1 >/dev/null && tj gen g2 >/dev/null && diff -r g1 g2 >/dev/null
result gen_is_repeatable $?
tj gen data >/dev/null

# 3. resume_after_kill: kill at step 4, relaunch, finish as attempt 1
tj run --pvc r --data data --die-at 4 --steps 10 >/dev/null; kill_exit=$?
ckpt_step=$(json_get r/checkpoint.json step)
tj run --pvc r --data data >/dev/null; resume_exit=$?
[ "$kill_exit" = 75 ] && [ "$ckpt_step" = 4 ] && [ "$resume_exit" = 0 ] \
  && [ "$(count killed r/log.jsonl)" = 1 ] && [ "$(count resumed r/log.jsonl)" -ge 1 ] \
  && [ "$(count completed r/log.jsonl)" = 1 ] && [ -f r/artifacts/model-v1.json ]
result resume_after_kill $?

# 4. artifact_sha_matches: the logged hash is the hash of the file on disk
file_sha=$(sha256sum r/artifacts/model-v1.json 2>/dev/null | cut -d' ' -f1)
log_sha=$(grep '"event":"artifact_written"' r/log.jsonl 2>/dev/null | sed -n 's/.*sha256=\([0-9a-f]*\) .*/\1/p' | tail -1)
[ -n "$file_sha" ] && [ "$file_sha" = "$log_sha" ]
result artifact_sha_matches $?

# 5. drift_fails_honestly: forced-zero weights score 14/20 and must be refused
tj run --pvc d --data data --force-weights 0,0,0 >/dev/null; drift_exit=$?
tj status d/log.jsonl >d.status; status_exit=$?
[ "$drift_exit" = 1 ] && [ "$status_exit" = 1 ] && grep -qx 'drift: fail' d.status \
  && grep -qx 'last_event: drift_failed' d.status && [ ! -e d/artifacts ] \
  && grep -q 'holdout: 14/20 vs baseline 20/20 (max drop 20%); refusing artifact' d/log.jsonl
result drift_fails_honestly $?

# 6. backoff_limit_honoured: limit 1 allows two attempts, the third start gives up
exits=""
for _ in 1 2 3; do tj run --pvc b --data data --backoff-limit 1 --force-weights 0,0,0 >/dev/null; exits="$exits$?,"; done
echo "backoff: exits=${exits%,} drift_failed=$(count drift_failed b/log.jsonl) job_failed=$(count job_failed b/log.jsonl) attempts_file=$(cat b/attempts 2>/dev/null)" >&2
[ "$exits" = "1,1,1," ] && [ "$(count drift_failed b/log.jsonl)" = 2 ] && [ "$(count job_failed b/log.jsonl)" = 1 ] \
  && [ "$(cat b/attempts 2>/dev/null)" = 2 ] && grep -q 'attempts=2 backoffLimit=1' b/log.jsonl
result backoff_limit_honoured $?

# 7. clean_run_completes
tj run --pvc c --data data >/dev/null; clean_exit=$?
tj status c/log.jsonl >c.status; clean_status=$?
[ "$clean_exit" = 0 ] && [ "$clean_status" = 0 ] && grep -qx 'last_event: completed' c.status
result clean_run_completes $?

# 8. status_and_usage_exit_2: a missing log and a bad flag are input errors, not failures
tj status does-not-exist.jsonl >/dev/null; missing=$?
tj run --pvc u --data data --steps 0 >/dev/null; badflag=$?
[ "$missing" = 2 ] && [ "$badflag" = 2 ]
result status_and_usage_exit_2 $?

# 9. checkpoint_is_json: the checkpoint left by a kill parses
"$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' r/checkpoint.json 2>/dev/null
result checkpoint_is_json $?

[ "$failures" -eq 0 ]
