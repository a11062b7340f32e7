#!/usr/bin/env bash
# Fleet benchmarks (BENCHMARKS.md, "Fleet"): builds the release binaries, writes a PKI and sets up
# an sshd on a loopback port in a temporary directory, runs `cargo bench --bench fleet`, and tears
# everything down on exit.
#
#   crates/bench/fleet-bench.sh                  # full run (a few minutes)
#   BENCH_QUICK=1 crates/bench/fleet-bench.sh    # under a minute once built: smaller sizes
#   FLEET_ONLY=fanout,memory crates/bench/fleet-bench.sh   # some sections only
#
# Needs root for the ssh baseline (installs openssh-server if missing, creates the user
# `toolsrvbench` with shell /bin/sh). Without it the ssh comparison is reported as skipped.
# All traffic stays on 127.0.0.1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target-bench}"
quick="${BENCH_QUICK:-0}"
ssh_user=toolsrvbench
ssh_alias=fleetbench

# A thousand TLS links need a thousand descriptors, in the load generator and the coordinator.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

work=$(mktemp -d /tmp/toolsrv-fleet.XXXXXX)
sshd_pid=""
ssh_cfg=""
cleanup() {
    set +e
    if [ -n "$ssh_cfg" ]; then
        timeout 5 ssh -F "$ssh_cfg" -O exit "$ssh_alias" >/dev/null 2>&1
    fi
    if [ -n "$sshd_pid" ]; then
        kill "$sshd_pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$sshd_pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$sshd_pid" 2>/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== building release binaries (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
(cd "$root" && cargo build --release --bins)
bin="$CARGO_TARGET_DIR/release"

# Agents: the real ones, and the load generator's stand-in hosts (fan-out and memory).
fakes=1000
[ "$quick" = 1 ] && fakes=50
agents="real-1,real-16,real-stream,real-idle,$(seq -f 'fake-%04g' 0 $((fakes - 1)) | paste -sd,)"
echo "== writing a PKI for $((fakes + 4)) agents"
"$bin/toolsrv" pki init "$work/pki" --agents "$agents" --clients bench >/dev/null

skip=""
# Sets up sshd on 127.0.0.1 and an ssh master connection; on failure sets $skip and returns 1.
setup_ssh() {
    if [ "$(id -u)" != 0 ]; then
        skip="not root: cannot install openssh-server, add a user or start sshd as another user"
        return 1
    fi
    if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null || ! command -v ssh-keygen >/dev/null; then
        echo "== installing openssh-server"
        if ! { timeout 300 apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq openssh-server openssh-client; } \
            >"$work/apt.log" 2>&1; then
            skip="openssh-server could not be installed: apt-get failed ($(tail -n 1 "$work/apt.log"))"
            return 1
        fi
    fi
    if ! id "$ssh_user" >/dev/null 2>&1; then
        useradd --create-home --shell /bin/sh "$ssh_user" || { skip="useradd $ssh_user failed"; return 1; }
    fi
    # '*' = no password but not locked: sshd without PAM refuses locked ('!') accounts.
    usermod -p '*' -s /bin/sh "$ssh_user" || { skip="usermod $ssh_user failed"; return 1; }
    local home
    home=$(getent passwd "$ssh_user" | cut -d: -f6)
    [ -d "$home" ] || { skip="home directory of $ssh_user ($home) is missing"; return 1; }
    mkdir -p "$work/ssh" /run/sshd
    ssh-keygen -q -t ed25519 -N '' -f "$work/ssh/host_key" || { skip="ssh-keygen failed"; return 1; }
    ssh-keygen -q -t ed25519 -N '' -f "$work/ssh/user_key" || { skip="ssh-keygen failed"; return 1; }
    install -d -m 700 -o "$ssh_user" "$home/.ssh"
    install -m 600 -o "$ssh_user" "$work/ssh/user_key.pub" "$home/.ssh/authorized_keys"
    local port=""
    for p in $(seq 2222 2299); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then port=$p; break; fi
    done
    [ -n "$port" ] || { skip="no free port in 127.0.0.1:2222-2299"; return 1; }
    cat >"$work/ssh/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $work/ssh/host_key
PidFile $work/ssh/sshd.pid
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
AllowUsers $ssh_user
PermitRootLogin no
X11Forwarding no
AllowTcpForwarding no
PrintMotd no
PrintLastLog no
UseDNS no
MaxSessions 64
EOF
    /usr/sbin/sshd -D -f "$work/ssh/sshd_config" -h "$work/ssh/host_key" -E "$work/ssh/sshd.log" &
    sshd_pid=$!
    local up=""
    for _ in $(seq 50); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then up=1; break; fi
        sleep 0.1
    done
    [ -n "$up" ] || { skip="sshd did not start: $(tail -n 3 "$work/ssh/sshd.log" 2>/dev/null)"; return 1; }
    echo "[127.0.0.1]:$port $(cat "$work/ssh/host_key.pub")" >"$work/ssh/known_hosts"
    cat >"$work/ssh/config" <<EOF
Host $ssh_alias
    HostName 127.0.0.1
    Port $port
    User $ssh_user
    IdentityFile $work/ssh/user_key
    IdentitiesOnly yes
    BatchMode yes
    UserKnownHostsFile $work/ssh/known_hosts
    StrictHostKeyChecking yes
    ControlMaster auto
    ControlPath $work/ssh/ctl-%C
    ControlPersist 15m
    LogLevel ERROR
EOF
    ssh_cfg="$work/ssh/config"
    if ! timeout 20 ssh -F "$ssh_cfg" -o ControlMaster=yes -fN "$ssh_alias" 2>"$work/ssh/master.log"; then
        skip="the ssh master connection failed: $(tail -n 2 "$work/ssh/master.log") $(tail -n 2 "$work/ssh/sshd.log")"
        return 1
    fi
    local answer
    answer=$(echo '{}' | timeout 10 ssh -F "$ssh_cfg" -T "$ssh_alias" 'cat >/dev/null; echo ok' 2>&1) || true
    [ "$answer" = ok ] || { skip="ssh test command failed: $answer"; return 1; }
    echo "== sshd on 127.0.0.1:$port (pid $sshd_pid), master connection up, user $ssh_user (shell /bin/sh)"
}

if setup_ssh; then
    export FLEET_SSH_CONFIG="$ssh_cfg" FLEET_SSH_HOST="$ssh_alias"
else
    echo "== ssh comparison SKIPPED: $skip"
    export FLEET_SSH_SKIP="$skip"
fi

export FLEET_BIN_DIR="$bin" FLEET_PKI="$work/pki" FLEET_WORK="$work" FLEET_EXAMPLES="$root/examples/tools"
echo "== load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
cd "$root"
status=0
cargo bench -p toolsrv-bench --bench fleet || status=$?
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$status" != 0 ]; then
    # Keep the coordinator and agent logs of a failed run; the rest goes with $work.
    logs=$(mktemp -d /tmp/toolsrv-fleet-logs.XXXXXX)
    cp "$work"/*.log "$logs"/ 2>/dev/null || true
    echo "== bench failed (exit $status); process logs kept in $logs"
fi
exit "$status"
