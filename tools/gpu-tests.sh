#!/usr/bin/env bash
# The GPU suite: on a GPU machine with torch/triton/cupy/transformers/peft preinstalled and no network.
# Puts every package's src on PYTHONPATH (no install), runs `pytest -m gpu` per package and over
# tests-integration/ and benchmarks/tests/ with TIDAL_REQUIRE_GPU=1, writes one merged JUnit XML (junit.xml), the full log
# (gpu-suite.log) and the summary (summary.txt) under $OUT when set — three files, since the GPU machine
# returns only a few — and prints a per-package passed/failed/time table last. Extra arguments go to
# every pytest call. GPU_SUITE_TARGETS (space-separated directories) narrows the run. Carry .whl/ to test
# against bitsandbytes too.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${OUT:-$root/.gpu-results}
parts=$(mktemp -d)  # per-package JUnit files and logs, merged into $out at the end
mkdir -p "$out"
export TIDAL_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(ls -d "$root"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
# bitsandbytes from .whl/ when carried (the NF4 byte-compatibility test needs it; the machine has no network):
# into a target directory on PYTHONPATH, as gpu-bench.sh does, since pip may serve another environment
if ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tidal-test-peers .whl/bitsandbytes-*.whl 2>/dev/null \
    && export PYTHONPATH="$PYTHONPATH:/tmp/tidal-test-peers"
fi
# tidal-testing is loaded as a plugin explicitly unless it is pip-installed (its entry point loads it then)
plugin=(-p tidal_testing.plugin)
if python3 -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'tidal_testing' for e in m.entry_points(group='pytest11')) else 1)"; then
  plugin=()
fi
targets=()
# GPU_SUITE_TARGETS="packages/tidal-plan/tests tests-integration" runs only those (a re-run after a fix)
for d in ${GPU_SUITE_TARGETS:-packages/*/tests tests-integration benchmarks/tests}; do
  [ -d "$d" ] && targets+=("$d")
done
summary=()
total_start=$(date +%s)
status=0
: >"$out/gpu-suite.log"
for t in "${targets[@]}"; do
  name=$(echo "$t" | sed 's#packages/##; s#/tests##')
  start=$(date +%s.%N)
  python3 -m pytest -m gpu "${plugin[@]}" -q "$t" --junitxml="$parts/junit-$name.xml" "$@" >"$parts/log-$name.txt" 2>&1
  rc=$?
  secs=$(python3 -c "print(f'{$(date +%s.%N)-$start:.1f}')")
  counts=$(python3 - "$parts/junit-$name.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    r = ET.parse(sys.argv[1]).getroot()
    s = r if r.tag == "testsuite" else r.find("testsuite")
    t, f, e, k = (int(s.get(x, 0)) for x in ("tests", "failures", "errors", "skipped"))
    print(f"{t - f - e - k} {f + e} {k}")
except Exception:
    print("0 0 0")
PY
)
  read -r passed failed skipped <<<"$counts"
  # exit 5 = nothing gpu-marked in that package: not a failure
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; tail -n 30 "$parts/log-$name.txt"; fi
  summary+=("$(printf '%-18s %7s %7s %8s %8ss' "$name" "$passed" "$failed" "$skipped" "$secs")")
  # written as each package ends, so a run cut short still leaves what finished
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  { echo "===== log-$name"; cat "$parts/log-$name.txt"; } >>"$out/gpu-suite.log"
done
python3 - "$out/junit.xml" "$parts"/junit-*.xml <<'PY'
import sys, xml.etree.ElementTree as ET
merged = ET.Element("testsuites")
for path in sys.argv[2:]:
    try:
        r = ET.parse(path).getroot()
    except Exception:
        continue
    merged.extend(r.findall("testsuite") if r.tag == "testsuites" else [r])
ET.ElementTree(merged).write(sys.argv[1])
PY
{
  printf '%-18s %7s %7s %8s %9s\n' package passed failed skipped time
  printf '%s\n' "${summary[@]}"
  echo "GPU suite: $(( $(date +%s) - total_start )) s total, status $status"
} | tee "$out/summary.txt"
rm -rf "$parts"
exit $status
