#!/usr/bin/env bash
# Run a command in a new network namespace that has only the loopback interface (the Ray tests: Ray then
# finds nothing but 127.0.0.x, so all its traffic stays on lo; flags alone do not keep every Ray component
# there). Needs unshare(1) from util-linux and permission to create a network namespace (root). Where that
# is not permitted the command runs as it is, and the Ray tests skip saying why (or fail, with
# MSP_REQUIRE_RAY_TESTS=1, as in CI).
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi
LO_UP='import fcntl, socket, struct
s = socket.socket()
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP'
if command -v unshare >/dev/null 2>&1 && unshare -n true 2>/dev/null; then
    # lo starts down in a new namespace: bring it up (ip from iproute2, else an ioctl from Python).
    exec unshare -n bash -c 'ip link set lo up 2>/dev/null || python3 -c "$1"; shift; exec "$@"' bash "$LO_UP" "$@"
fi
echo "note: cannot create a network namespace here (unshare -n); running without one" >&2
exec "$@"
