#!/usr/bin/env bash
# The GPU check on a borrowed GPU machine (no network, the repository's tree plus 64 MiB of carried files a call),
# in two back-to-back calls on the same warm machine (docs/benchmarks.md, "The first real GPU"):
#
#   call 1 (carry .gpu-bundle/a, timeout_s 180):  bash bench/gpu_check/device.sh install-a
#   call 2 (carry .gpu-bundle/b, timeout_s 480):  bash bench/gpu_check/device.sh run [python -m bench.gpu_check options]
#
# call 2's check keeps to 420 s from this script's start (--budget-s), leaving 60 s to write the table and stop.
#
# install-a puts bitsandbytes and transformers into the image's torch venv (the trainer's venv here). run installs
# part b (the trainer's other wheels; the worker's venv from its lock; sd-scripts at the pinned commit; the CLIP
# tokenizers; bubblewrap from its .deb when the image has none) and then runs `python -m bench.gpu_check` with the
# worker's venv, writing the table, its JSON and the logs into $OUT. Each step leaves a stamp under $LW_GPU_ROOT, so
# a second `run` on the same machine goes straight to the check. Nothing here needs the network.
set -uo pipefail
export LW_GPU_CHECK_T0=${LW_GPU_CHECK_T0:-$(date +%s.%N)}  # the check's time budget counts from here
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BUNDLE=$REPO/.gpu-bundle
ROOT=${LW_GPU_ROOT:-/opt/lw-gpu}
PY=${LW_GPU_PYTHON:-python3}
OUT=${OUT:-$REPO/var/gpu-check}
mkdir -p "$ROOT" "$OUT"
LOG=$OUT/install.log

say() { echo "[gpu-check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
fail() { say "FAILED: $*"; exit 1; }
trainer_venv() { "$PY" -c 'import sys; assert sys.prefix != sys.base_prefix, "python3 is not a venv"; print(sys.prefix)'; }
wheels_into_trainer() {
  "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check "$1"/*.whl >>"$LOG" 2>&1
}

install_a() {
  [ -f "$ROOT/.a-installed" ] && { say "part a: installed already"; return 0; }
  ls "$BUNDLE"/a/*.whl >/dev/null 2>&1 || fail "no $BUNDLE/a: run \`make gpu-bundle\` and carry .gpu-bundle/a"
  wheels_into_trainer "$BUNDLE/a" || fail "pip install of part a (see install.log)"
  touch "$ROOT/.a-installed"
  say "part a into $(trainer_venv): $(cd "$BUNDLE/a" && ls *.whl | tr '\n' ' ')"
}

worker_venv() {
  [ -x "$REPO/.venv/bin/gunicorn" ] && [ -f "$REPO/.venv/.runtime" ] && return 0
  local wheels=$BUNDLE/b/worker pip
  pip=$(ls "$wheels"/pip-*.whl) || return 1
  "$PY" -m venv --without-pip "$REPO/.venv" &&
    "$REPO/.venv/bin/python" "$pip/pip" install -q --no-index "$pip" &&
    "$REPO/.venv/bin/python" -m pip install -q --no-index --find-links "$wheels" --require-hashes --no-deps \
      -r "$REPO/deploy/requirements.lock" &&
    (cd "$REPO" && .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e .) &&
    touch "$REPO/.venv/.runtime"
}

sd_scripts() {
  [ -f "$ROOT/sd-scripts/sdxl_train_network.py" ] && return 0
  tar -xzf "$BUNDLE/b/sd-scripts.tar.gz" -C "$ROOT"  # with a .git whose HEAD names the pinned commit (bundle.py)
}

choose_sandbox() {  # SANDBOX: the image's bwrap, else the carried .deb's, else none (and why, for the table)
  local deb missing
  if command -v bwrap >/dev/null; then SANDBOX=(--bwrap "$(command -v bwrap)"); return; fi
  deb=$(ls "$BUNDLE"/b/deb/bubblewrap_*.deb 2>/dev/null | head -1)
  if [ -z "$deb" ]; then SANDBOX=(--sandbox-none "the image has no bwrap and no bubblewrap .deb was carried"); return; fi
  [ -x "$ROOT/bwrap/usr/bin/bwrap" ] || dpkg -x "$deb" "$ROOT/bwrap" >>"$LOG" 2>&1
  missing=$(ldd "$ROOT/bwrap/usr/bin/bwrap" 2>&1 | sed -n 's/^[[:space:]]*\([^[:space:]]*\) => not found.*/\1/p' | tr '\n' ' ')
  if [ -n "$missing" ] || [ ! -x "$ROOT/bwrap/usr/bin/bwrap" ]; then
    SANDBOX=(--sandbox-none "the image has no bwrap, and $(basename "$deb") lacks libraries here: ${missing:-it did not unpack}")
    return
  fi
  SANDBOX=(--bwrap "$ROOT/bwrap/usr/bin/bwrap")
}

cuda_loader() {  # NOTES += what was done. The trainer's environment is an allow-list (no LD_LIBRARY_PATH), so
  # libcuda.so.1 must be in ld.so.cache, as on a host whose driver was installed; an image may find it by the
  # variable alone. Then its folder goes into ld.so.conf.d (root, on a machine lent for minutes), and the table says so.
  local d paths=${LD_LIBRARY_PATH:-}
  ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && return 0
  for d in ${paths//:/ } /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/libcuda.so.1" ]; then
      echo "$d" >/etc/ld.so.conf.d/zz-lw-gpu-check.conf && ldconfig &&
        NOTES+=(--host-note "libcuda.so.1 was not in ld.so.cache (found by LD_LIBRARY_PATH alone): $d added to it")
      return 0
    fi
  done
  NOTES+=(--host-note "libcuda.so.1 is in neither ld.so.cache nor LD_LIBRARY_PATH's folders")
}

install_b() {
  [ -f "$ROOT/.a-installed" ] || fail "part a is not installed on this machine: call 1 (install-a) first, on the same warm machine"
  [ -d "$BUNDLE/b" ] || fail "no $BUNDLE/b: carry .gpu-bundle/b"
  if [ ! -f "$ROOT/.b-installed" ]; then
    wheels_into_trainer "$BUNDLE/b/trainer" || fail "pip install of the trainer's part b (see install.log)"
    touch "$ROOT/.b-installed"
  fi
  worker_venv >>"$LOG" 2>&1 || fail "the worker's venv (see install.log)"
  sd_scripts >>"$LOG" 2>&1 || fail "sd-scripts"
  [ -d "$ROOT/tokenizers" ] || cp -r "$BUNDLE/b/tokenizers" "$ROOT/tokenizers" || fail "tokenizers"
  say "part b installed: trainer venv $(trainer_venv), worker venv $REPO/.venv, sd-scripts $ROOT/sd-scripts"
}

case "${1:-}" in
  install-a) install_a ;;
  run)
    shift
    install_b
    choose_sandbox
    NOTES=()
    cuda_loader
    say "sandbox: ${SANDBOX[*]}; ${NOTES[*]}"
    cd "$REPO" || fail "no $REPO"
    exec "$REPO/.venv/bin/python" -m bench.gpu_check --trainer-venv "$(trainer_venv)" --sd-scripts "$ROOT/sd-scripts" \
      --tokenizers "$ROOT/tokenizers" --work "$ROOT/work" --out "$OUT" "${SANDBOX[@]}" "${NOTES[@]}" "$@" ;;
  *) echo "usage: $0 install-a | run [options]" >&2; exit 2 ;;
esac
