# Sourced by run_h200.sh: a device call brings back at most 8 files from $OUT (the device tool's
# limit; the thirty-seventh session lost four logs to it). `pack_out DIR` folds every file of DIR
# but the compile cache's parts (`cache.tgz.*`) into one `logs.tgz` once there are more than 8
# (`pack_out DIR force`: always), taking in a `logs.tgz` an earlier run of the same call left.
# (The tar is written outside DIR first: written inside, tar saw the folder change and failed.)
pack_out() {
  local dir=$1 force=${2:-} tmp
  [ -d "$dir" ] || return 0
  [ "$force" = force ] || [ "$(find "$dir" -type f | wc -l)" -gt 8 ] || return 0
  tmp=$(mktemp -d)
  (
    cd "$dir" || exit 1
    if [ -f logs.tgz ]; then tar -xzf logs.tgz && rm logs.tgz; fi
    tar -czf "$tmp/logs.tgz" --exclude='cache.tgz.*' . &&
      find . -type f ! -name 'cache.tgz.*' -delete &&
      find . -mindepth 1 -type d -empty -delete &&
      mv "$tmp/logs.tgz" .
  )
  rmdir "$tmp" 2>/dev/null
  return 0
}
