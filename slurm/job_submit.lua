-- odfs: refuse at submission a batch script whose #ODFS lines odfs would reject when the job
-- starts (the job would otherwise be allocated, fail in its prolog and end without running).
--
-- Install on the slurmctld host: odfs at the path below, this file next to slurm.conf as
-- job_submit.lua (or call odfs_check_script from the job_submit.lua you have), and
--   JobSubmitPlugins=lua
-- in slurm.conf. `odfs check-script job.sh` runs the same check by hand.

local ODFS = "/usr/local/bin/odfs"

-- nil when the script is fine (or cannot be checked here), else odfs's message.
function odfs_check_script(script)
  if script == nil or not string.find(script, "#ODFS", 1, true) then
    return nil
  end
  local path = os.tmpname()
  local f = io.open(path, "w")
  if f == nil then
    slurm.log_error("odfs: cannot write %s to check a batch script", path)
    return nil
  end
  f:write(script)
  f:close()
  local p = io.popen(ODFS .. " check-script --name 'batch script' " .. path .. " 2>&1; echo \"rc=$?\"")
  local out = p:read("*a")
  p:close()
  os.remove(path)
  local rc = tonumber(string.match(out, "rc=(%d+)%s*$"))
  if rc == 0 then
    return nil
  end
  if rc == nil or rc == 126 or rc == 127 then
    -- odfs is not installed here: the prolog checks the script when the job starts.
    slurm.log_error("odfs: cannot run %s check-script: %s", ODFS, out)
    return nil
  end
  return (string.gsub(out, "rc=%d+%s*$", ""))
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local msg = odfs_check_script(job_desc.script)
  if msg ~= nil then
    slurm.log_user("%s", msg)
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
