#!/usr/bin/env bash
# simhosts.sh: simulated hosts for multi-host Open MPI runs on one machine (docs/MULTIHOST.md).
#
# N hosts are N network namespaces gsh-<pid>-h1..hN, each with one veth interface `gsh0`
# (198.18.0.<i>/24) whose other end is port p<i> of a bridge br0 that lives in its own
# namespace gsh-<pid>-sw (the "switch"). mpirun itself runs in a launcher namespace
# gsh-<pid>-l (198.18.0.254, port pl), like a login node, so no rank runs where mpirun does.
# Only 198.18.0.0/15 (RFC 2544, for benchmarks) is used, and only inside these namespaces:
# the root namespace's interfaces, addresses and routes are never touched (every veth is
# created inside the switch namespace with its peer placed directly in the host's).
#
# As a command:
#   simhosts.sh [--hosts N] [--rate R --burst B] [--limit S] -- COMMAND [ARGS...]
#     brings the hosts up, runs COMMAND in the launcher namespace with the GSH_* variables
#     below and OMPI_MCA_* settings exported (so a plain `mpirun -np 4 ...` there uses the
#     hosts), then removes everything. Exit status: COMMAND's. Example:
#       testing/simhosts.sh --hosts 2 --rate 1gbit -- mpirun -np 4 hostname
#   simhosts.sh sweep    removes gsh-<pid>-* namespaces whose <pid> is no longer alive.
# As a library (what the tests do):
#   source testing/simhosts.sh
#   simhosts_require_netns          # prints "SKIPPED: <why>" and exits 0 if namespaces fail
#   simhosts_up 2 [RATE BURST]      # e.g. simhosts_up 2 1gbit 256kb; installs the trap
#   simhosts_mpirun -np 4 --map-by ppr:2:node BINARY ARGS...
#   simhosts_link 2 down; simhosts_link 2 up
#   simhosts_exec 1 COMMAND...      # a command "on" host 1 (bounded by timeout)
#   simhosts_kill_host 2 [SIGNAL]   # signal every process in host 2's namespace
#   simhosts_link_bytes 2           # "RX TX" byte counters of host 2's interface
#   simhosts_cleanup                # also run by the EXIT/INT/TERM trap
# Variables after simhosts_up: GSH_PREFIX, GSH_DIR (hostfile, agent), GSH_HOSTS (count),
# GSH_HOSTFILE, GSH_AGENT, GSH_RANK (the rank wrapper, see simhosts_up), GSH_NS_SW,
# GSH_NS_LAUNCH, and gsh_host_ns I / gsh_host_name I. GSH_SLOTS (default 2) is each host's
# slot count in the hostfile. At most 253 hosts (198.18.0.1-253).
#
# Open MPI is restricted to `btl tcp,vader,self` (shared memory only between ranks of one
# host: vader never connects processes that different daemons launched) with
# btl_tcp_if_include / oob_tcp_if_include = gsh0, so everything between hosts crosses the
# veth links (and their tbf limits). The rsh agent ($GSH_AGENT) starts each orted "on" a host
# with `ip netns exec <ns> unshare --uts`, setting the hostname to the simulated host's name,
# so each host has its own Open MPI session directory. mpi_yield_when_idle=1: every simulated
# host believes its slots are its own cores, so Open MPI would busy-poll; all hosts share this
# machine's cores, and 4 spinning ranks on 2 cores made a tiny step take 1-2.5 s instead of
# about 0.03 s. orte_leave_session_attached=1 keeps each daemon a child of the agent (not
# daemonized), so the agent's timeout bounds it.
#
# GSH_TCP_RETRIES2, if set, is net.ipv4.tcp_retries2 inside every namespace made (default:
# the kernel's 15, about 15 minutes before TCP gives up on a peer that stopped answering;
# after a partition mpirun waits that long for the lost host's daemon, docs/MULTIHOST.md).
#
# Bounds: every ip/tc command runs under `timeout` (GSH_CMD_TIMEOUT_S, default 10 s); mpirun
# and the daemons the agent starts under GSH_LIMIT_S (default 600 s, then SIGKILL). The
# trap (EXIT, INT, TERM) SIGKILLs every process left in the namespaces, deletes the
# namespaces (which removes their veths and the bridge) and GSH_DIR. Bash runs a trap only
# once the foreground command has returned, so a script that sources this file should run
# long commands in the background and `wait` (as the command form does) if a TERM must act
# at once; the foreground ones here are all bounded anyway. A run that was itself SIGKILLed
# leaves gsh-<pid>-*; `simhosts.sh sweep` (also run by simhosts_up) removes those whose pid
# is gone.
#
# Skipping: where `ip netns add` fails (not root, no CAP_SYS_ADMIN, no /run/netns),
# simhosts_require_netns prints "SKIPPED: cannot create network namespaces (ip netns add:
# <ip's message>; needs root or CAP_SYS_ADMIN)" and exits 0, which Bazel counts as a pass (Bazel 4 has no skipped status); the line is in
# the test log.

# Bazel runs tests with PATH=/bin:/usr/bin:/usr/local/bin; ip and tc live in /usr/sbin.
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin:/sbin" ;; esac
GSH_CMD_TIMEOUT_S="${GSH_CMD_TIMEOUT_S:-10}"
GSH_LIMIT_S="${GSH_LIMIT_S:-600}"
GSH_PREFIX="${GSH_PREFIX:-gsh-$$}"
GSH_HOSTS=0
GSH_DIR=""
GSH_NS_SW="${GSH_PREFIX}-sw"
GSH_NS_LAUNCH="${GSH_PREFIX}-l"
GSH_IF=gsh0

_gsh_t() { timeout --signal=KILL "${GSH_CMD_TIMEOUT_S}" "$@"; }
gsh_host_ns() { echo "${GSH_PREFIX}-h$1"; }
gsh_host_name() { echo "${GSH_PREFIX}-h$1"; }
gsh_host_addr() { echo "198.18.0.$1"; }

# Exits 0 with "SKIPPED: ..." where network namespaces cannot be made.
simhosts_require_netns() {
  local why
  for tool in ip tc timeout unshare mpirun; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "SKIPPED: simulated hosts need '$tool', which is not on PATH"
      exit 0
    fi
  done
  if ! why=$(_gsh_t ip netns add "${GSH_PREFIX}-probe" 2>&1); then
    echo "SKIPPED: cannot create network namespaces (ip netns add: ${why:-timed out}; needs root or CAP_SYS_ADMIN)"
    exit 0
  fi
  # What simhosts_up builds inside them: a bridge and a veth pair (kernels or containers
  # without the bridge or veth drivers, or without CAP_NET_ADMIN there, refuse these).
  local probe="${GSH_PREFIX}-probe"
  if ! why=$({ _gsh_t ip -n "$probe" link add gshbr type bridge &&
               _gsh_t ip -n "$probe" link add gsha type veth peer name gshb; } 2>&1); then
    _gsh_t ip netns del "$probe" 2>/dev/null || true
    echo "SKIPPED: network namespaces work but cannot hold a bridge and a veth pair (${why:-timed out})"
    exit 0
  fi
  _gsh_t ip netns del "$probe" 2>/dev/null || true
}

# Removes namespaces of earlier runs (gsh-<pid>-*) whose pid is not alive.
simhosts_sweep() {
  local ns pid
  for ns in $(_gsh_t ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^gsh-[0-9]+-' || true); do
    pid="${ns#gsh-}"; pid="${pid%%-*}"
    if [[ "$pid" != "$$" ]] && ! kill -0 "$pid" 2>/dev/null; then
      _gsh_kill_ns "$ns" KILL
      _gsh_t ip netns del "$ns" 2>/dev/null || true
    fi
  done
}

_gsh_kill_ns() {  # _gsh_kill_ns NS SIGNAL
  local pids
  pids=$(_gsh_t ip netns pids "$1" 2>/dev/null || true)
  [[ -n "$pids" ]] && kill -"$2" $pids 2>/dev/null
  return 0
}

_gsh_namespaces() {
  local i
  echo "$GSH_NS_LAUNCH"
  for ((i = 1; i <= GSH_HOSTS; i++)); do gsh_host_ns "$i"; done
  echo "$GSH_NS_SW"
}

simhosts_cleanup() {
  local ns
  trap - EXIT INT TERM
  for ns in $(_gsh_namespaces); do _gsh_kill_ns "$ns" KILL; done
  for ns in $(_gsh_namespaces) "${GSH_PREFIX}-probe"; do
    if [[ -e "/run/netns/$ns" ]]; then _gsh_t ip netns del "$ns" 2>/dev/null || true; fi
  done
  [[ -n "$GSH_DIR" && -d "$GSH_DIR" ]] && rm -rf "$GSH_DIR"
  GSH_HOSTS=0
  return 0
}

# One namespace on the bridge: _gsh_attach NS PORT ADDRESS RATE BURST
_gsh_attach() {
  local ns="$1" port="$2" addr="$3" rate="$4" burst="$5"
  _gsh_t ip netns add "$ns" || return 1
  _gsh_t ip -n "$ns" link set lo up || return 1
  if [[ -n "${GSH_TCP_RETRIES2:-}" ]]; then
    # Per-namespace: how many retransmissions before TCP gives up on an unanswered peer.
    _gsh_t ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_retries2="$GSH_TCP_RETRIES2" || return 1
  fi
  _gsh_t ip -n "$GSH_NS_SW" link add "$port" type veth peer name "$GSH_IF" netns "$ns" || return 1
  _gsh_t ip -n "$GSH_NS_SW" link set "$port" master br0 || return 1
  _gsh_t ip -n "$GSH_NS_SW" link set "$port" up || return 1
  _gsh_t ip -n "$ns" addr add "$addr/24" dev "$GSH_IF" || return 1
  _gsh_t ip -n "$ns" link set "$GSH_IF" up || return 1
  if [[ -n "$rate" ]]; then
    # Both directions: the host's egress and the switch port's egress towards the host.
    _gsh_t tc -n "$ns" qdisc add dev "$GSH_IF" root tbf rate "$rate" burst "$burst" latency 50ms || return 1
    _gsh_t tc -n "$GSH_NS_SW" qdisc add dev "$port" root tbf rate "$rate" burst "$burst" latency 50ms || return 1
  fi
}

# simhosts_up N [RATE BURST]: N hosts, optionally each link limited by tbf (e.g. 1gbit 256kb).
simhosts_up() {
  local n="$1" rate="${2:-}" burst="${3:-256kb}" i
  simhosts_sweep
  GSH_HOSTS="$n"
  trap 'simhosts_cleanup' EXIT
  trap 'simhosts_cleanup; exit 130' INT
  trap 'simhosts_cleanup; exit 143' TERM
  GSH_DIR="$(mktemp -d "${TEST_TMPDIR:-/tmp}/simhosts.XXXXXX")"
  _gsh_t ip netns add "$GSH_NS_SW" || { echo "simhosts: ip netns add failed" >&2; return 1; }
  _gsh_t ip -n "$GSH_NS_SW" link add br0 type bridge || return 1
  _gsh_t ip -n "$GSH_NS_SW" link set br0 up || return 1
  _gsh_attach "$GSH_NS_LAUNCH" pl 198.18.0.254 "$rate" "$burst" || return 1
  : > "$GSH_DIR/hostfile"
  : > "$GSH_DIR/hosts.map"
  for ((i = 1; i <= n; i++)); do
    _gsh_attach "$(gsh_host_ns "$i")" "p$i" "$(gsh_host_addr "$i")" "$rate" "$burst" || return 1
    echo "$(gsh_host_name "$i") slots=${GSH_SLOTS:-2}" >> "$GSH_DIR/hostfile"
    echo "$(gsh_host_name "$i") $(gsh_host_ns "$i")" >> "$GSH_DIR/hosts.map"
  done
  GSH_HOSTFILE="$GSH_DIR/hostfile"
  GSH_AGENT="$GSH_DIR/agent"
  # Open MPI calls the agent as `agent [options] HOST COMMAND...` and expects COMMAND to be
  # run by a shell on HOST, as ssh does.
  cat > "$GSH_AGENT" <<EOF
#!/usr/bin/env bash
while [[ \$# -gt 0 && "\$1" == -* ]]; do shift; done
host="\$1"; shift
ns=\$(awk -v h="\$host" '\$1 == h {print \$2}' "$GSH_DIR/hosts.map")
if [[ -z "\$ns" ]]; then echo "simhosts agent: unknown host '\$host'" >&2; exit 1; fi
exec timeout --signal=KILL "$GSH_LIMIT_S" ip netns exec "\$ns" unshare --uts \\
  /bin/sh -c 'hostname "\$0" && exec /bin/sh -c "\$1"' "\$host" "\$*"
EOF
  chmod +x "$GSH_AGENT"
  # The rank wrapper: `rank LOGDIR COMMAND...` runs one rank with its output in
  # LOGDIR/rank<R>.log on the rank's own host (so a partitioned host's output is kept), and
  # records "PID HOST" in rank<R>.pid and "STATUS EPOCH_SECONDS" in rank<R>.exit when the
  # rank ends. A TERM/INT/HUP sent to the wrapper (Open MPI signals the process group) is
  # left to the rank itself; a SIGKILL of the wrapper leaves no .exit file.
  GSH_RANK="$GSH_DIR/rank"
  cat > "$GSH_RANK" <<'EOF'
#!/usr/bin/env bash
d="$1"; shift
r="${OMPI_COMM_WORLD_RANK:-x}"
trap ':' TERM INT HUP
"$@" > "$d/rank$r.log" 2>&1 &
c=$!
echo "$c $(hostname)" > "$d/rank$r.pid"
while :; do wait "$c"; rc=$?; kill -0 "$c" 2>/dev/null || break; done
echo "$rc $EPOCHREALTIME" > "$d/rank$r.exit"  # a builtin: no child for a signal to kill
exit "$rc"
EOF
  chmod +x "$GSH_RANK"
  export GSH_PREFIX GSH_DIR GSH_HOSTS GSH_HOSTFILE GSH_AGENT GSH_RANK GSH_NS_SW GSH_NS_LAUNCH
}

# simhosts_mpirun MPIRUN_ARGS...: mpirun in the launcher namespace over the simulated hosts.
simhosts_mpirun() {
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    timeout --signal=KILL "$GSH_LIMIT_S" ip netns exec "$GSH_NS_LAUNCH" \
    mpirun --hostfile "$GSH_HOSTFILE" \
      --mca plm_rsh_agent "$GSH_AGENT" --mca plm_rsh_no_tree_spawn 1 \
      --mca btl "${GSH_BTL:-tcp,vader,self}" --mca btl_vader_single_copy_mechanism none \
      --mca btl_tcp_if_include "$GSH_IF" --mca oob_tcp_if_include "$GSH_IF" \
      --mca orte_leave_session_attached 1 --mca mpi_yield_when_idle 1 \
      --oversubscribe --bind-to none "$@"
}

# simhosts_link I up|down: the switch-side end of host I's link (a cable pulled at the
# switch: the host's own interface stays up, its packets go nowhere; nothing is refused).
simhosts_link() {
  _gsh_t ip -n "$GSH_NS_SW" link set "p$1" "$2"
}

# simhosts_exec I COMMAND...: COMMAND inside host I's namespace, bounded by GSH_LIMIT_S.
simhosts_exec() {
  local i="$1"; shift
  timeout --signal=KILL "$GSH_LIMIT_S" ip netns exec "$(gsh_host_ns "$i")" "$@"
}

# simhosts_kill_host I [SIGNAL]: signals every process in host I's namespace (default KILL).
simhosts_kill_host() {
  _gsh_kill_ns "$(gsh_host_ns "$1")" "${2:-KILL}"
}

# simhosts_link_bytes I: "rx tx" bytes of host I's interface.
simhosts_link_bytes() {
  local ns; ns="$(gsh_host_ns "$1")"
  echo "$(_gsh_t ip netns exec "$ns" cat /sys/class/net/$GSH_IF/statistics/rx_bytes)" \
       "$(_gsh_t ip netns exec "$ns" cat /sys/class/net/$GSH_IF/statistics/tx_bytes)"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -uo pipefail
  hosts=2 rate="" burst=256kb
  if [[ "${1:-}" == sweep ]]; then simhosts_sweep; exit 0; fi
  while [[ $# -gt 0 && "$1" != "--" ]]; do
    case "$1" in
      --hosts) hosts="$2"; shift 2 ;;
      --rate) rate="$2"; shift 2 ;;
      --burst) burst="$2"; shift 2 ;;
      --limit) GSH_LIMIT_S="$2"; shift 2 ;;
      *) echo "usage: simhosts.sh [--hosts N] [--rate R --burst B] [--limit S] -- COMMAND..." >&2; exit 2 ;;
    esac
  done
  [[ "${1:-}" == "--" ]] && shift
  [[ $# -gt 0 ]] || { echo "simhosts.sh: no command" >&2; exit 2; }
  simhosts_require_netns
  simhosts_up "$hosts" "$rate" "$burst" || { echo "simhosts.sh: could not bring the hosts up" >&2; exit 1; }
  # Open MPI options for a command that calls mpirun itself (from the launcher namespace).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_plm_rsh_agent="$GSH_AGENT" OMPI_MCA_plm_rsh_no_tree_spawn=1
  export OMPI_MCA_btl=tcp,vader,self OMPI_MCA_btl_vader_single_copy_mechanism=none
  export OMPI_MCA_btl_tcp_if_include="$GSH_IF" OMPI_MCA_oob_tcp_if_include="$GSH_IF"
  export OMPI_MCA_orte_default_hostfile="$GSH_HOSTFILE" OMPI_MCA_rmaps_base_oversubscribe=1
  export OMPI_MCA_orte_leave_session_attached=1 OMPI_MCA_mpi_yield_when_idle=1
  # In the background, so that a TERM or INT runs the trap at once (bash runs traps only
  # between foreground commands; `wait` is interrupted by them).
  timeout --signal=KILL "$GSH_LIMIT_S" ip netns exec "$GSH_NS_LAUNCH" "$@" &
  wait $!
  exit $?
fi
