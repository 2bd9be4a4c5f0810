-- Argo CD resource health check for tpuft.dev/TPUFineTune.
-- Install: the argocd-cm ConfigMap key "resource.customizations.health.tpuft.dev_TPUFineTune"
-- (docs/gitops.md). Argo CD calls this with the live object as `obj` and reads back
-- {status = "Healthy" | "Progressing" | "Suspended" | "Degraded" | "Unknown", message = "..."}.
--
-- status.phase is written by the tpuft operator only:
--   Preparing, Pending, Queued, Running -> Progressing   (the run is on its way; the message says why it waits)
--   Suspended                -> Suspended     (spec.suspend is true)
--   Succeeded                -> Healthy       (training finished)
--   Failed                   -> Degraded      (with the operator's message: exit code, restarts, field)
-- A status the operator has not yet brought up to the current spec (observedGeneration behind
-- metadata.generation) is Progressing, so a sync waits for the operator to look at the new spec.

local hs = {}

local function text(value)
  if value == nil then
    return ""
  end
  return tostring(value)
end

local function with_progress(message, status)
  if status.progress ~= nil and status.progress.summary ~= nil and status.progress.summary ~= "" then
    if message == "" then
      return text(status.progress.summary)
    end
    return message .. "; " .. text(status.progress.summary)
  end
  return message
end

local status = obj.status
if status == nil or status.phase == nil or status.phase == "" then
  hs.status = "Progressing"
  hs.message = "waiting for the tpuft operator to report a status"
  return hs
end

local phase = status.phase
local message = text(status.message)
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local observed = status.observedGeneration

if generation ~= nil and observed ~= nil and tonumber(observed) < tonumber(generation) then
  hs.status = "Progressing"
  hs.message = "the operator has not yet observed generation " .. text(generation) ..
    " (status is of generation " .. text(observed) .. ", phase " .. text(phase) .. ")"
  return hs
end

if phase == "Succeeded" then
  hs.status = "Healthy"
  if message == "" then
    message = "training finished"
  end
  hs.message = message
elseif phase == "Failed" then
  hs.status = "Degraded"
  if message == "" then
    message = "the fine-tune failed (kubectl describe tpuft " .. text(obj.metadata and obj.metadata.name) .. ")"
  end
  hs.message = message
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message
elseif phase == "Preparing" or phase == "Pending" or phase == "Queued" then
  hs.status = "Progressing"
  hs.message = phase .. ": " .. message
elseif phase == "Running" then
  hs.status = "Progressing"
  hs.message = with_progress("Running: " .. message, status)
else
  hs.status = "Unknown"
  hs.message = "unknown phase " .. text(phase) .. ": " .. message
end
return hs
