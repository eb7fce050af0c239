# Sourced by .ci/run and scripts/demo.sh: installs the system packages the local cluster needs
# (etcd, iproute2 for network namespaces, the RDMA libraries Mooncake's wheel links against;
# openssl makes the certificates of the etcd TLS tests).

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
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need[*]} (run: sudo apt-get install ${need[*]})" >&2
    exit 2
  fi
  echo "[sysdeps] apt-get install ${need[*]}"
  _sysdeps_apt update -qq || exit $?
  _sysdeps_apt install -y -qq "${need[@]}" || exit $?
fi
