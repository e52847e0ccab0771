#!/usr/bin/env bash
# Study: does `make test` pass in a fresh clone 5 times in a row on one commit while a CPU-heavy job runs?
# (issue 17's reliability target). Each run clones the repository, checks out COMMIT and runs `make test`
# (which builds its own .venv); a one-thread float32 matmul loop runs beside all five, and is stopped at the
# end. One line per run goes to OUT/summary.txt: exit status, seconds, load averages at its end, and the
# pytest result line.
#
#   bash benchmarks/studies/suite_under_load.sh [COMMIT] [OUT]    # about 1-2 hours on 2 cores
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
commit=${1:-$(git -C "$repo" rev-parse HEAD)}
out=${2:-/tmp/suite_under_load}
mkdir -p "$out"
python3 -c 'import torch' 2>/dev/null && load_python=python3 || load_python="$repo/.venv/bin/python"
"$load_python" -c '
import torch
torch.set_num_threads(1)
a = torch.randn(768, 768)
while True:
    a = torch.tanh(a @ a)
' &
load_pid=$!
trap 'kill $load_pid 2>/dev/null' EXIT
echo "commit $commit start $(date -u +%H:%M:%S)" > "$out/summary.txt"
for i in 1 2 3 4 5; do
  clone="$out/clone_$i"
  rm -rf "$clone"
  git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  start=$(date +%s)
  (cd "$clone" && timeout 2700 make test > "$out/run_$i.log" 2>&1)
  rc=$?
  result=$(grep -E '[0-9]+ (passed|failed)' "$out/run_$i.log" | tail -1)
  echo "run $i rc=$rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1-3 /proc/loadavg) $result" >> "$out/summary.txt"
  rm -rf "$clone"
done
echo "end $(date -u +%H:%M:%S)" >> "$out/summary.txt"
