#!/usr/bin/env bash
# Fleet benchmarks (BENCHMARKS.md, "Fleet"): builds the release binaries, writes a PKI and sets up
# an sshd on a loopback port in a temporary directory, runs `cargo bench --bench fleet`, and tears
# everything down on exit.
#
#   crates/bench/fleet-bench.sh                  # full run (a few minutes)
#   BENCH_QUICK=1 crates/bench/fleet-bench.sh    # under a minute once built: smaller sizes
#   FLEET_ONLY=fanout,memory crates/bench/fleet-bench.sh   # some sections only (also: replicas)
#   FLEET_ONLY=scale FLEET_SCALE_AGENTS=10000 crates/bench/fleet-bench.sh   # one coordinator,
#                                                # 10,000 stand-in hosts (only when named)
#   FLEET_ONLY=failover FLEET_REPLICA_AGENTS=10000 crates/bench/fleet-bench.sh   # 3 replicas on
#                                                # etcd, one killed, then all (only when named)
#   FLEET_ONLY=find crates/bench/fleet-bench.sh  # FindTools against 1,000 tools through a real
#                                                # coordinator, lexical and with the encoder
#                                                # (TOOLSRV_FIND_MODEL; FLEET_FIND_HOSTS stand-in
#                                                # hosts, default 10; only when named)
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

# Stand-in hosts for the fan-out and memory sections, and for `scale` when it is asked for.
fakes=1000
[ "$quick" = 1 ] && fakes=50
scale=0
case ",${FLEET_ONLY:-}," in
*,scale,*)
    scale="${FLEET_SCALE_AGENTS:-10000}"
    [ "$quick" = 1 ] && [ -z "${FLEET_SCALE_AGENTS:-}" ] && scale=200
    [ "$scale" -gt "$fakes" ] && fakes=$scale
    ;;
esac
# `failover`: three replicas on etcd and FLEET_REPLICA_AGENTS stand-in hosts (only when named).
case ",${FLEET_ONLY:-}," in
*,failover,*)
    spread="${FLEET_REPLICA_AGENTS:-3000}"
    [ "$quick" = 1 ] && [ -z "${FLEET_REPLICA_AGENTS:-}" ] && spread=150
    [ "$spread" -gt "$fakes" ] && fakes=$spread
    ;;
esac

# Every TLS link is a descriptor in the load generator and one in the coordinator (each process
# has its own limit): N links need N descriptors plus the processes' own.
want_fds=$((fakes + 4096))
[ "$want_fds" -lt 65536 ] && want_fds=65536
ulimit -n "$want_fds" 2>/dev/null || ulimit -n "$(ulimit -Hn)"

work=$(mktemp -d /tmp/toolsrv-fleet.XXXXXX)
# The PKI goes on a tmpfs when there is one: `pki init` syncs every file it writes (as it should
# for real keys), which on this VM's disk costs about 2.7 ms a file, about 57 s for 10,000
# agents; on tmpfs the sync is free (0.4 s per 1,000 agents). These throwaway keys need no
# durability.
pki="$work/pki"
shm=""
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    shm=$(mktemp -d /dev/shm/toolsrv-fleet-pki.XXXXXX) && pki="$shm/pki"
fi
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
    [ -n "$shm" ] && rm -rf "$shm"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== building release binaries (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
(cd "$root" && cargo build --release --bins)
bin="$CARGO_TARGET_DIR/release"

# Agents: the real ones, and the load generator's stand-in hosts. `pki init` adds to an existing
# PKI, so the stand-ins go in batches of 1,000 (one command line argument must stay under
# 128 KiB).
echo "== writing a PKI for $((fakes + 4)) agents"
pki_started=$(date +%s%N)
"$bin/toolsrv" pki init "$pki" --agents real-1,real-16,real-stream,real-idle --clients bench >/dev/null
for ((from = 0; from < fakes; from += 1000)); do
    to=$((from + 1000 < fakes ? from + 1000 : fakes))
    "$bin/toolsrv" pki init "$pki" --agents "$(seq -f 'fake-%04g' "$from" $((to - 1)) | paste -sd,)" >/dev/null
done
echo "== PKI written in $((($(date +%s%N) - pki_started) / 1000000)) ms"

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

# Only the latency section compares with ssh.
case ",${FLEET_ONLY:-latency}," in
*,latency,*) ;;
*) skip="FLEET_ONLY=${FLEET_ONLY} has no ssh comparison" ;;
esac
if [ -z "$skip" ] && setup_ssh; then
    export FLEET_SSH_CONFIG="$ssh_cfg" FLEET_SSH_HOST="$ssh_alias"
else
    echo "== ssh comparison SKIPPED: $skip"
    export FLEET_SSH_SKIP="$skip"
fi

export FLEET_BIN_DIR="$bin" FLEET_PKI="$pki" FLEET_WORK="$work" FLEET_EXAMPLES="$root/examples/tools"
echo "== load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
cd "$root"
status=0
# FLEET_BENCH_PROFILE=release builds the bench (and the load generator in it) with the release
# profile, reusing the dependencies the binaries were just built with, instead of compiling them
# all again for the `bench` profile.
cargo bench -p toolsrv-bench --bench fleet ${FLEET_BENCH_PROFILE:+--profile "$FLEET_BENCH_PROFILE"} || status=$?
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$status" != 0 ]; then
    # Keep the coordinator and agent logs of a failed run; the rest goes with $work.
    logs=$(mktemp -d /tmp/toolsrv-fleet-logs.XXXXXX)
    cp "$work"/*.log "$logs"/ 2>/dev/null || true
    echo "== bench failed (exit $status); process logs kept in $logs"
fi
exit "$status"
