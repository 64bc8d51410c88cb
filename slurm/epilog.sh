#!/bin/sh
# odfs Slurm epilog (slurm.conf: Epilog=/etc/odfs/epilog.sh).
#
# Runs on every node of every job, as root, after the job. For jobs that asked for odfs,
# `odfs stop`: node 0 stages the outputs out and verifies them; every node then unmounts,
# stops its daemons and wipes its data — or keeps it and exits non-zero if the outputs could
# not be verified (`odfs recover --job ID` finishes the job later). Other jobs cost nothing.
case "$SLURM_JOB_CONSTRAINTS" in
  *odfs*) ;;
  *) exit 0 ;;
esac
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
if [ -r /etc/odfs/slurm.env ]; then . /etc/odfs/slurm.env; fi
[ -n "$ODFS_SITE_CONFIG" ] && export ODFS_SITE_CONFIG
exec "${ODFS_BIN:-odfs}" stop
