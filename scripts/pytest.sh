#!/usr/bin/env bash
# pytest with one exit path forgiven: an abort (SIGABRT, exit 134) of the interpreter *after* the
# session ended with every test passed. Usage: scripts/pytest.sh PYTHON [pytest args...]
#
# Why: CPython 3.11 ends a daemon thread that wakes up during interpreter finalization with
# pthread_exit, and when that thread is inside pybind11 code (a torch call that released the GIL)
# the unwind hits a noexcept destructor and std::terminate aborts the process ("terminate called
# without an active exception"; pytorch/pytorch#38228, open). CI once aborted so after "893 passed";
# LocalEngine's worker was one such thread (now closed at exit), the weight-sync rendezvous thread
# waiting out its timeout is another that nothing can stop, and which one it was is not known.
# tests/conftest.py writes the session's exit status to a file the moment the session ends; an
# abort after a 0 there is reported loudly and does not fail the run. An abort before it (a crash
# during a test) leaves no file, and fails as always. PYTHONFAULTHANDLER makes such an abort print
# every thread's Python stack: what a fix of the cause needs.
set -uo pipefail
py=$1
shift
# Two test processes on a machine with two or more CPUs (pytest-xdist, whole files per process, so
# module fixtures load once): one process left a 2-core machine half idle. Each gets its share of
# the CPUs as torch threads, so the two do not oversubscribe the cores. AGENTGRPO_TEST_WORKERS=0
# runs everything in one process.
cpus=$(nproc)
workers=${AGENTGRPO_TEST_WORKERS:-$((cpus >= 2 ? 2 : 0))}
parallel=()
if [ "$workers" -gt 1 ] && "$py" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / workers > 0 ? cpus / workers : 1))}
fi
status=$(mktemp)  # empty until conftest writes the status at the session end
AGENTGRPO_PYTEST_STATUS_FILE=$status PYTHONFAULTHANDLER=1 "$py" -m pytest -q -p no:cacheprovider \
  "${parallel[@]}" "$@"
rc=$?
ended=$(cat "$status")
rm -f "$status"
if [ "$rc" = 134 ] && [ "$ended" = 0 ]; then
  echo "WARNING: pytest passed, then the interpreter aborted during its exit (SIGABRT; the stacks" \
    "above, if any, show the threads): pytorch/pytorch#38228, see scripts/pytest.sh. Not a test failure." >&2
  exit 0
fi
exit "$rc"
