#!/bin/sh
# odfs Slurm prolog (slurm.conf: Prolog=/etc/odfs/prolog.sh, PrologFlags=Alloc).
#
# Runs on every node of every job, as root, at allocation. Jobs that ask for odfs
# (--constraint=odfs, or a variant such as odfs_ram) get `odfs start`: this node's daemons,
# its mount, and on node 0 the wait for every node and the job's stage-in. Other jobs cost
# nothing: the case below is all they run.
#
# Settings for this wrapper (optional, sourced): /etc/odfs/slurm.env
#   ODFS_BIN=/usr/local/bin/odfs          the odfs binary
#   ODFS_SITE_CONFIG=/etc/odfs/site.toml  the site config
case "$SLURM_JOB_CONSTRAINTS" in
  *odfs*) ;;
  *) exit 0 ;;
esac
# Slurm gives prologs an almost empty environment (no PATH).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
if [ -r /etc/odfs/slurm.env ]; then . /etc/odfs/slurm.env; fi
[ -n "$ODFS_SITE_CONFIG" ] && export ODFS_SITE_CONFIG
exec "${ODFS_BIN:-odfs}" start
