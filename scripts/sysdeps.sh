# Sourced by .ci/run and scripts/demo.sh: installs the system packages the local cluster needs
# (etcd, iproute2 for network namespaces, the RDMA libraries Mooncake's wheel links against;
# openssl makes the certificates of the etcd TLS tests).
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
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
