#!/usr/bin/env bash
# Compiled kernels carried from one GPU machine to the next. A fresh machine spends ~200 s of a device call compiling
# lily's and MLX's kernels in its first process (NVRTC to PTX, then the driver to machine code); both compilers keep
# what they made in a folder (MLX_PTX_CACHE_DIR, CUDA_CACHE_PATH), so a machine that starts with the last one's
# folders skips them. The caches are keyed by the kernels' text (and the driver's version for machine code): a kernel
# changed since is compiled again, a stale entry is never used.
#
#   eval "$(bash bench/device_kernel_cache.sh env)"        # in every command on the machine: the caches under $KC
#   bash bench/device_kernel_cache.sh save "$OUT"          # after the runs: $OUT/kcache.tar.xz.part-aa, -ab, ...
#                                                          # (parts under 15 MiB, what a device call brings back)
#   bash bench/device_kernel_cache.sh restore .device/kc   # on the next machine, before the runs, from those parts
#                                                          # copied into the ignored folder .device/kc (carried)
#
# KC (default /root/kc) is where the caches live on the machine; KC_XZ_LEVEL (default -6) the compression. A call brings back at most 8 files of 16 MiB and
# 64 MiB in all, and the working tree a call carries is at most 64 MiB: save in a call that returns little else,
# and carry .device/kc in a call of its own (between .device/a's and .device/b's, or after them).
set -euo pipefail
KC=${KC:-/root/kc}
# xz, or Python's lzma where the machine has no xz (the same format)
compress() {
  if command -v xz > /dev/null; then xz -T0 "${KC_XZ_LEVEL:--6}"
  else python3 -c 'import lzma, shutil, sys
with lzma.open(sys.stdout.buffer, "wb", preset=abs(int(sys.argv[1]))) as f: shutil.copyfileobj(sys.stdin.buffer, f)' "${KC_XZ_LEVEL:--6}"
  fi
}
decompress() {
  if command -v xz > /dev/null; then xz -d
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'
  fi
}
case "${1:-}" in
  env)
    echo "export MLX_PTX_CACHE_DIR=$KC/ptx CUDA_CACHE_PATH=$KC/nv CUDA_CACHE_MAXSIZE=4294967296"
    ;;
  save)
    out=${2:?usage: save OUT_DIR}
    [ -d "$KC" ] || { echo "no kernel caches under $KC (run with: eval \"\$(bash $0 env)\")" >&2; exit 1; }
    mkdir -p "$out"
    tar -C "$KC" -cf - . | compress | split -b 15m - "$out/kcache.tar.xz.part-"
    du -sh "$KC"/* 2>/dev/null || true
    ls -l "$out"/kcache.tar.xz.part-*
    ;;
  restore)
    from=${2:?usage: restore PARTS_DIR}
    ls "$from"/kcache.tar.xz.part-* > /dev/null 2>&1 || { echo "no kcache.tar.xz.part-* in $from" >&2; exit 1; }
    mkdir -p "$KC"
    cat "$from"/kcache.tar.xz.part-* | decompress | tar -C "$KC" -xf -
    du -sh "$KC"/* 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 env | save OUT_DIR | restore PARTS_DIR" >&2
    exit 2
    ;;
esac
