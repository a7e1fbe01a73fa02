#!/bin/sh
# Host packages for the kernel nvmet backend (emulator/src/adp_emulator/kernel) and the interop tests.
# Debian/Ubuntu; run as root or with sudo.  CI runs exactly this.
#   qemu-system-x86  qemu-system-x86_64 (boots the guest; TCG works without /dev/kvm)
#   kmod             depmod (writes modules.dep for the unpacked kernel package)
#   cpio             only for a test that cross-checks our cpio writer
#   tshark           tshark + dumpcap (wireshark-common): testbed/tests/test_wire_tshark.py captures loopback
#                    NVMe/TCP traffic and decodes it with the nvme-tcp dissector. The debconf question
#                    "should non-superusers be able to capture packets?" is preseeded to false (no setuid
#                    dumpcap); the tests run dumpcap as root in CI. To capture as a normal user instead:
#                    setcap cap_net_raw,cap_net_admin+eip /usr/bin/dumpcap
#   apt, dpkg        apt-get download / dpkg-deb -x (present on every Debian system)
# The guest kernel (linux-image-<ver>-amd64) and busybox-static are NOT installed: the image builder
# fetches them with `apt-get download` into ${ADP_KV_CACHE:-~/.cache/adp-kv}/guest/<kernel-version>/.
set -eu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "wireshark-common wireshark-common/install-setuid boolean false" | $SUDO debconf-set-selections
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends \
  qemu-system-x86 kmod cpio ca-certificates debian-archive-keyring tshark
