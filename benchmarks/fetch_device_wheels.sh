#!/usr/bin/env bash
# Fetch (here, where PyPI is reachable) what the H200 image lacks, for the device call to carry:
#   .whl/      the server extra and its dependencies for CPython 3.12 (the HTTP server, W5), and
#              py-spy (bench_tail.py --gil-profile: which Python holds the server's GIL), and
#              pytest-xdist (`GPU_TEST_ARGS="-n 8"`: the GPU tests' Triton and Inductor builds in
#              parallel workers, most of a gpu-tests phase's time on one CPU)
#   .whl-ray/  a slimmed Ray Serve (benchmarks/bench_ray.py --prepare-wheels)      --with-ray
#   .tools/    wrk (a compiled load generator) with its LuaJIT library, from apt      --with-wrk
# All are git-ignored through .git/info/exclude; name them in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
for d in /.whl/ /.whl-ray/ /.tools/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 \
  prometheus-client==0.26.0 httpx==0.28.1 pyyaml==6.0.4 uvloop==0.23.0 py-spy==0.4.3 \
  pytest-xdist==3.8.0 execnet==2.1.2
for arg in "$@"; do
  case $arg in
    --with-ray) python3 benchmarks/bench_ray.py --prepare-wheels .whl-ray ;;
    --with-wrk)
      command -v wrk >/dev/null || { apt-get install -y -q wrk >/dev/null || sudo apt-get install -y -q wrk >/dev/null; }
      mkdir -p .tools/lib
      cp "$(command -v wrk)" .tools/lib/wrk
      cp "$(ldd "$(command -v wrk)" | awk '/libluajit/ {print $3}')" .tools/lib/
      # a wrapper, so the carried LuaJIT is found without touching anyone else's library path
      printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/lib/wrk" "$@"\n' > .tools/wrk
      chmod +x .tools/wrk ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
# only what exists: du's status for a missing folder would fail a run that fetched everything asked
for d in .whl .whl-ray .tools; do [ -e $d ] && du -sh $d; done; true
