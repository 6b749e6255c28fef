#!/usr/bin/env bash
# Mutation testing of ONE module against the tests that cover it, with mutmut 3. A developer's tool: CI never runs it
# (install it with `pip install -e '.[test,mutation]'`); tests/MUTATION.md records its results per module.
#
#   tests/mutate.sh lightning_ckpt/core/measure/cost_fit.py tests/core/plan/test_cost_fit.py [more test files, node ids, pytest args]
#
# Examples:
#   tests/mutate.sh lightning_ckpt/core/plan/budget_cycle.py tests/core/plan/test_cost_fit.py tests/core/plan/test_budget_cycle.py \
#       --deselect tests/core/plan/test_budget_cycle.py::test_a_transformers_llama_on_batches_padded_per_batch_holds_a_byte_budget_on_every_step
#   MUTATE_ONLY='*x_plan_checkpointing__mutmut_* *xǁ_TileFlopsǁ*' tests/mutate.sh ...
#                                        # only the mutants of these functions (mutmut's names, fnmatch globs): an
#                                        # audit of new code in a long module
#   MUTATE_REUSE=1 tests/mutate.sh ...   # keep the last run's results: run again only the mutants of changed functions
#                                        # and those the last run did not kill (after adding tests for them). mutmut maps
#                                        # new test functions to what they call, not a test edited in place: add new
#                                        # tests, or run afresh (the default), for the final figures
#
# How: mutmut reads its settings from ./pyproject.toml, so the run happens in mutants/<module>/ (git-ignored): a
# snapshot of lightning_ckpt/, tests/, benchmarks/, configs/ and examples/ (others may edit the tree meanwhile) and this
# pyproject.toml with a [tool.mutmut] section for the one module (its tests with `-o addopts=`: the project's
# `--doctest-modules` would run every module). mutmut copies the snapshot into its own mutants/ there, and runs, for
# each mutant, the selected tests that call the mutated function. The tree itself is never mutated.
#
# The report (printed, and in mutants/<module>/report.txt): the counts, and the diff of every mutant that survived or
# timed out. mutmut's timeout is (the tests' time + 1 s) x 15 of wall time, which a busy machine can reach with a
# mutant that only fails slowly; so each timed-out mutant is applied to the snapshot and its tests run again with no
# limit but MUTATE_TIMEOUT (default 300 s) of wall time: "timeout, real" when still running then (an endless loop),
# else killed or survived as it ended.
#
# Environment: PYTHON (default .venv/bin/python, else python), MUTATE_CHILDREN (parallel mutants, default 2),
# MUTATE_TIMEOUT, MUTATE_REUSE, MUTATE_ONLY.
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
root=$(cd "$(dirname "$0")/.." && pwd)
module=$1; shift
case $module in lightning_ckpt/*.py) ;; *) echo "mutate.sh: the module is a path like lightning_ckpt/core/measure/cost_fit.py, got $module" >&2; exit 2 ;; esac
[ -f "$root/$module" ] || { echo "mutate.sh: no $module" >&2; exit 2; }
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=$(command -v python)
"$python" -c "import mutmut" 2>/dev/null || { echo "mutate.sh: mutmut is not installed: pip install -e '.[test,mutation]'" >&2; exit 2; }
name=$(basename "${module%.py}")
work=$root/mutants/$name
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
started=$SECONDS

# --- the snapshot and its configuration
if [ -z "${MUTATE_REUSE:-}" ]; then rm -rf "$work"; fi
mkdir -p "$work"
for dir in lightning_ckpt tests benchmarks configs examples; do
    mkdir -p "$work/$dir"
    # a copy; files that did not change keep their time stamps, so a reused run re-tests only changed functions
    (cd "$root" && tar --exclude=__pycache__ -cf - "$dir") | (cd "$work" && tar -xpf -)
done
"$python" - "$root/pyproject.toml" "$work/pyproject.toml" "$module" "$@" <<'EOF'
import json, sys
source, target, module, *tests = sys.argv[1:]
text = open(source).read().split("\n[tool.mutmut]")[0]
# TOML strings written as JSON strings (same escapes for these paths and options)
setting = lambda values: "[" + ", ".join(json.dumps(v) for v in values) + "]"
text += f"""
[tool.mutmut]
source_paths = ["lightning_ckpt"]
only_mutate = {setting([module])}
also_copy = ["benchmarks", "configs", "examples"]
pytest_add_cli_args = ["-o", "addopts=", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
pytest_add_cli_args_test_selection = {setting(tests)}
"""
open(target, "w").write(text)
EOF

# --- the run
cd "$work"
echo "mutate.sh: $module against $*, in $work"
children=${MUTATE_CHILDREN:-2}
again=""
if [ -n "${MUTATE_REUSE:-}" ] && [ -d mutants ]; then
    # mutmut keeps a result until its function changes: the mutants that were not killed are run again explicitly
    # (those mutmut ran: under MUTATE_ONLY the others are "not checked" and stay so)
    again=$("$python" -m mutmut results 2>/dev/null \
        | awk -F': ' '($2 == "survived" || $2 == "timeout" || $2 == "suspicious") && NF == 2 {gsub(/ /, "", $1); print $1}')
fi
set -f  # MUTATE_ONLY's globs go to mutmut as they are, not matched against files here
# shellcheck disable=SC2086
"$python" -m mutmut run --max-children "$children" ${MUTATE_ONLY:-} > run.log 2>&1 || { tail -40 run.log; echo "mutate.sh: mutmut failed (run.log above)"; exit 1; }
set +f
if [ -n "$again" ]; then
    # shellcheck disable=SC2086
    "$python" -m mutmut run --max-children "$children" $again >> run.log 2>&1 || { tail -40 run.log; echo "mutate.sh: mutmut failed (run.log above)"; exit 1; }
fi
ran=$((SECONDS - started))

# --- timeouts checked again, one at a time, without mutmut's limit
"$python" -m mutmut results --all true > results.txt
cp "$module" "$module.orig"
: > timeouts.txt
for mutant in $(awk -F': ' '$2 == "timeout" {gsub(/ /, "", $1); print $1}' results.txt); do
    # one test id a line; a parametrized id may hold spaces ("[plan, no loss]")
    mapfile -t tests < <("$python" -m mutmut tests-for-mutant "$mutant")
    "$python" -m mutmut apply "$mutant" > /dev/null
    set +e
    timeout "${MUTATE_TIMEOUT:-300}" "$python" -m pytest -x -q -o addopts= -p no:cacheprovider "${tests[@]}" > "timeout-$mutant.log" 2>&1
    rc=$?
    set -e
    cp "$module.orig" "$module"
    # 1: a test failed; 124: still running at the limit; anything else (pytest's usage error 4, no tests 5) is not a verdict
    case $rc in 124) verdict="timeout, real" ;; 0) verdict=survived ;; 1) verdict=killed ;; *) verdict="error $rc (see timeout-$mutant.log)" ;; esac
    echo "$mutant: $verdict" >> timeouts.txt
done
rm "$module.orig"

# --- the report
"$python" - "$module" "$ran" "$((SECONDS - started))" "$*" "${MUTATE_ONLY:-}" <<'EOF' | tee report.txt
import fnmatch, subprocess, sys
module, ran, total, tests, only = sys.argv[1:]
status = {}
for line in open("results.txt"):
    if ": " in line:
        key, value = line.strip().rsplit(": ", 1)
        if not only or any(fnmatch.fnmatch(key, pattern) for pattern in only.split()):
            status[key] = value
rechecked = dict(line.strip().rsplit(": ", 1) for line in open("timeouts.txt") if ": " in line)
counts = {}
for value in status.values():
    counts[value] = counts.get(value, 0) + 1
late_killed = sum(v == "killed" for v in rechecked.values())
late_survived = [k for k, v in rechecked.items() if v == "survived"]
real = [k for k, v in rechecked.items() if v == "timeout, real"]
killed = counts.get("killed", 0) + late_killed
survived = [k for k, v in status.items() if v == "survived"] + late_survived
other = {k: v for k, v in status.items() if v not in ("killed", "survived", "timeout")}
other.update({k: v for k, v in rechecked.items() if v.startswith("error")})  # a re-run that gave no verdict
print(f"module: {module}{' (only ' + only + ')' if only else ''}\ntests: {tests}")
print(f"mutants: {len(status)}; killed: {killed} ({counts.get('killed', 0)} by mutmut, {late_killed} of its"
      f" {counts.get('timeout', 0)} timeouts when run again without its limit); real timeouts (endless): {len(real)};"
      f" survived: {len(survived)}; other: {len(other)} {sorted(set(other.values()))}")
print(f"time: mutmut {ran} s, the whole script {total} s")
for title, names in (("survived", survived), ("real timeouts", real), ("other (no tests, suspicious, ...)", list(other))):
    if names:
        print(f"\n=== {title}")
    for mutant in names:
        diff = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], capture_output=True, text=True).stdout
        print("\n".join(line for line in diff.splitlines() if not line.startswith(("---", "+++"))))
EOF
