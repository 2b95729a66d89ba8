# Sourced by the run_h200*.sh scripts on the device machine: install the carried wheels (`.whl`, and
# `.whl-ray` when present; see fetch_device_wheels.sh) into /tmp/site and put it on PYTHONPATH; a carried
# `.tools` (wrk) goes on PATH.
install_device_wheels() {
  [ -x .tools/wrk ] && export PATH="$PWD/.tools:$PATH"
  ls .whl/*.whl >/dev/null 2>&1 || return 0
  local extra=(.whl/*.whl)
  ls .whl-ray/*.whl >/dev/null 2>&1 && extra+=(.whl-ray/*.whl)
  # once per machine: a second run_h200.sh in the same call only puts them on the path again
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "${extra[@]}" && touch /tmp/site/.installed; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" PATH="/tmp/site/bin:$PATH"  # (py-spy's binary)
}
