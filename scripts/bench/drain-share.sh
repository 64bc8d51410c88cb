#!/bin/bash
# Needs root, /dev/fuse, s3s-fs and bc; run from the repository after cargo build --release.
# What a continuous drain costs a job: 3 rounds of 4 writers x SZ MiB (dd 4M, fsync)
# through the mount, with no drain, with a drain and no share (--share 100), with the
# default share (20%), with --share 50, and with a fixed bandwidth cap.
set -e
B=${ODFS_BIN_DIR:-target/release}
R=${ROOT:-/tmp/odfs-drain-bench}
SZ=${SZ:-256}
export AWS_ACCESS_KEY_ID=AKIDODFSBENCH AWS_SECRET_ACCESS_KEY=secretsecretsecret AWS_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true
run() {  # $1 = label, $2.. = drain args (none: no drain)
  label=$1; shift
  $B/odfs local down --root $R >/dev/null 2>&1 || true
  pkill -f "s3s-fs --host 127.0.0.1 --port 19555" || true
  rm -rf $R; mkdir -p $R/s3/out
  s3s-fs --host 127.0.0.1 --port 19555 --access-key $AWS_ACCESS_KEY_ID --secret-key $AWS_SECRET_ACCESS_KEY $R/s3 > $R/s3.log 2>&1 &
  sleep 1
  $B/odfs local up --root $R/fs --nodes 4 --mount $R/mnt >/dev/null
  mkdir $R/mnt/ckpt
  if [ $# -gt 0 ]; then
    $B/odfs --fs $R/fs/odfs.toml drain start odfs:/ckpt s3://out/run --settle 1 --endpoint-url http://127.0.0.1:19555 --path-style "$@" >/dev/null
  fi
  for r in 1 2 3; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    t0=$(date +%s.%N)
    pids=""
    for w in 1 2 3 4; do dd if=/dev/zero of=$R/mnt/ckpt/r$r-w$w bs=4M count=$((SZ/4)) conv=fsync status=none & pids="$pids $!"; done
    wait $pids
    t1=$(date +%s.%N)
    echo "$label round $r: $(echo "4*$SZ/($t1-$t0)" | bc -l | cut -c1-6) MiB/s"
  done
  if [ $# -gt 0 ]; then
    t0=$(date +%s.%N)
    while ! $B/odfs --fs $R/fs/odfs.toml drain status | grep -q ' 0 pending, 0 in flight, 12 uploaded'; do sleep 0.5; done
    echo "$label: all 12 drained $(echo "$(date +%s.%N)-$t0" | bc -l | cut -c1-5) s after the last write; $($B/odfs --fs $R/fs/odfs.toml drain status)"
  fi
  $B/odfs local down --root $R/fs >/dev/null 2>&1 || true
  pkill -f "s3s-fs --host 127.0.0.1 --port 19555" || true
}
run "no drain"
run "drain, --share 100 (no share)" --share 100
run "drain, default share (20%)" --concurrency 2
run "drain, --share 50" --share 50
run "drain, --max-bandwidth 64M, --share 100" --max-bandwidth 64M --share 100
