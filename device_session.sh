#!/usr/bin/env bash
# One device call of this session (not part of the project).
set -uo pipefail
export PYTHONPATH=/root/site:$PWD LILY_BACKEND=cuda
mkdir -p $OUT/abl
timeout 345 python -m bench.ablations --size full --max-length 4K --rounds 2 --gen-tokens 32 --out $OUT/abl > $OUT/abl/log.txt 2>&1
echo rc=$?; tail -25 $OUT/abl/log.txt; cat $OUT/abl/ablations.md 2>/dev/null | head -30
