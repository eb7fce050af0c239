# Sourced by both README commands (scripts/demo.sh, scripts/test.sh) and .ci/run: installs the
# system packages that are missing (Debian/Ubuntu, root): what the local cluster needs (etcd,
# iproute2 for network namespaces, the RDMA libraries and libcurl Mooncake's wheel links against; openssl makes
# the certificates of the etcd TLS tests) and what scripts/env.sh needs to build the environment
# (python3's venv module, a C++ compiler and the Python headers for l2core's native extension).

# apt-get "$@", waiting while another apt/dpkg holds the lock (unattended-upgrades on a freshly
# booted VM runs for minutes): up to SYSDEPS_LOCK_WAIT seconds (default 600), with one message.
_sysdeps_apt() {
  local limit=${SYSDEPS_LOCK_WAIT:-600} poll=${SYSDEPS_LOCK_POLL:-5} said="" out rc
  local deadline=$((SECONDS + limit))
  while :; do
    out=$(DEBIAN_FRONTEND=noninteractive apt-get "$@" 2>&1) && return 0 || rc=$?
    if ! grep -qiE 'could not get lock|unable to acquire the dpkg|is another process using it' <<<"$out"; then
      echo "$out" >&2
      echo "[sysdeps] apt-get $1 failed (exit $rc)" >&2
      return "$rc"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "[sysdeps] apt/dpkg is still locked by another process after ${limit} s: $(grep -iE 'lock' <<<"$out" | head -1)" >&2
      echo "[sysdeps] hint: wait for it (ps aux | grep -E 'apt|dpkg|unattended'), or raise SYSDEPS_LOCK_WAIT" >&2
      return "$rc"
    fi
    if [ -z "$said" ]; then
      said=1
      echo "[sysdeps] another apt/dpkg holds its lock (unattended-upgrades on a fresh machine?); waiting up to ${limit} s" >&2
    fi
    sleep "$poll"
  done
}

need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v ip >/dev/null || need+=(iproute2)
command -v openssl >/dev/null || need+=(openssl)
ldconfig -p | grep -q libibverbs.so.1 || need+=(libibverbs1 librdmacm1)
ldconfig -p | grep -q libcurl.so.4 || need+=(libcurl4)  # mooncake_master and the wheel's .so files link it
if ! command -v python3 >/dev/null; then
  need+=(python3 python3-venv python3-dev)
else
  # Debian's python3 lacks ensurepip (python3-venv) and Python.h (python3-dev) until installed;
  # a python3 of its own (pyenv, a distribution's full build) has both
  python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
  python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    2>/dev/null || need+=(python3-dev)
fi
command -v c++ >/dev/null || command -v g++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need[*]} (run: sudo apt-get install ${need[*]})" >&2
    exit 2
  fi
  if ! command -v apt-get >/dev/null; then
    echo "missing system packages: ${need[*]}; this script installs them with apt-get (Debian/Ubuntu): install them with your package manager" >&2
    exit 2
  fi
  echo "[sysdeps] apt-get install ${need[*]}"
  _sysdeps_apt update -qq || exit $?
  _sysdeps_apt install -y -qq "${need[@]}" || exit $?
fi
