#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the H200 image lacks, for the device call to carry:
#   .whl/      fastapi + uvicorn + pydantic + orjson (the HTTP server, W5)
#   .whl-ray/  a slimmed Ray Serve (benchmarks/bench_ray.py --prepare-wheels)
# Both folders are git-ignored through .git/info/exclude; name them in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.whl-ray/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 uvicorn==0.54.0 \
  typing-inspection==0.4.2 annotated-types==0.7.0 opentelemetry-api==1.45.2 orjson==3.13.0
[ "${1:-}" = "--with-ray" ] && python3 benchmarks/bench_ray.py --prepare-wheels .whl-ray
du -sh .whl .whl-ray 2>/dev/null
