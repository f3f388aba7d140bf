# Sourced by deploy/image.sh and scripts/clusterset.sh: a small Debian root file system as a tar
# file, made by mmdebstrap from the mirror apt uses on this machine (no registry, no engine).

# The mirror apt uses here (deb822 or one-line sources), else Debian's.
apt_mirror() {
  local m
  m=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1 || true)
  [[ -z $m ]] && m=$(awk '$1 == "deb" && $0 !~ /security/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# debian_rootfs SUITE PACKAGES(comma-separated) OUT.tar: essential packages plus PACKAGES,
# without documentation, manuals, locales or apt's lists and caches.
debian_rootfs() {
  mmdebstrap --quiet --variant=apt --include="$2" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    --format=tar "$1" "$3" "$(apt_mirror)" </dev/null
}
