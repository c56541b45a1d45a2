#!/bin/bash
# What removing a pod without exclusions costs on a node where other pods have many, with two
# builds side by side: `unenrol-exclusions.sh BEFORE_BIN_DIR AFTER_BIN_DIR` (each a directory
# holding a release meshpath-loader). Root; it makes its own pin root and network namespaces
# and removes them on exit. N pods get 64 excluded ports and 16 excluded prefixes each (64 x N
# EXCLUDED_PORTS entries); then, per round and build, M plain pods are enrolled and removed
# with that build's `meshpath-loader unenrol` (wall time per removal, process start included).
# Not a test, and not run by CI: an A/B recorded in results/ab/.
set -eu
BEFORE=$1 AFTER=$2
N=${N:-200} M=${M:-20} ROUNDS=${ROUNDS:-3}
R=/sys/fs/bpf/mp-ab-$$
P=mpab$$-
cleanup() {
    for ns in $(ip netns list | awk -v p="$P" 'index($1, p) == 1 {print $1}'); do ip netns del "$ns"; done
    rm -rf "$R"
}
trap cleanup EXIT
loader() { "$1/meshpath-loader" --pin-root "$R" "${@:2}" >/dev/null; }
netns() { ip netns add "$1" && ip -n "$1" link set lo up; }
excl=()
for p in $(seq 20001 20064); do excl+=(--exclude-outbound-port "$p"); done
for c in $(seq 1 16); do excl+=(--exclude-outbound-cidr "10.$((100 + c)).0.0/16"); done
for i in $(seq 1 "$N"); do
    netns "${P}e$i"
    loader "$AFTER" enrol --netns "/var/run/netns/${P}e$i" --pod-ip "10.90.$((i / 250)).$((i % 250 + 1))" \
        --capture-outbound --no-counters "${excl[@]}"
done
echo "$N pods with exclusions: $((N * 64)) EXCLUDED_PORTS entries, $((N * 16)) EXCLUDED_CIDRS entries"
for round in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        [ "$side" = before ] && bin=$BEFORE || bin=$AFTER
        for j in $(seq 1 "$M"); do
            netns "${P}$side$round-$j"
            loader "$bin" enrol --netns "/var/run/netns/${P}$side$round-$j" --pod-ip "10.91.$round.$j" \
                --capture-outbound --no-counters
        done
        start=$(date +%s%N)
        for j in $(seq 1 "$M"); do
            loader "$bin" unenrol --netns "/var/run/netns/${P}$side$round-$j"
        done
        end=$(date +%s%N)
        echo "round $round, $side: $(((end - start) / M / 1000)) us per removal of a pod without exclusions"
    done
done
