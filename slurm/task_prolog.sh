#!/bin/sh
# odfs Slurm TaskProlog (slurm.conf: TaskProlog=/etc/odfs/task_prolog.sh).
#
# Runs as the job's user before each task; what it prints as `export NAME=value` enters the
# task's environment: ODFS_MOUNT (the job's mount point) and ODFS_JOB, when the job has an
# odfs mount on this node.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
if [ -r /etc/odfs/slurm.env ]; then . /etc/odfs/slurm.env; fi
[ -n "$ODFS_SITE_CONFIG" ] && export ODFS_SITE_CONFIG
exec "${ODFS_BIN:-odfs}" task-env
