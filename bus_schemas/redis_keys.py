"""Every Redis key of the mesh, and the one server-side script that reads them per request.

Layout (kept current by the index service from KV events):
- `hc:page:{page_hash}`      HASH  engine_id -> tier bits (1 device, 2 host)
- `hc:engine:{id}:pages`     SET   page hashes the engine holds (to clear it at once)
- `hc:engine:{id}:meta`      HASH  epoch, seq, bucket, namespace
- `hc:engine:{id}:alive`     STRING epoch, with a TTL refreshed by heartbeats
- `hc:engines`               SET   engine ids the index knows
Page hashes already cover namespace and cache_salt (see page_hash.py), so one key space
serves every namespace without mixing them.
"""

from __future__ import annotations

DEVICE_BIT = 1
HOST_BIT = 2
TIER_BITS = {"device": DEVICE_BIT, "host": HOST_BIT}

ENGINES = "hc:engines"


def page(page_hash: str) -> str:
    return f"hc:page:{page_hash}"


def engine_pages(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:pages"


def engine_meta(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:meta"


def engine_alive(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:alive"


# KEYS: page keys of one prompt, in order. Returns a flat array
# [engine_id, prefix_pages, device_prefix_pages, ...]: for every engine holding the first page,
# how many leading pages it holds in any tier, and how many of those on the device.
PREFIX_LOOKUP_LUA = """
local first = redis.call('HGETALL', KEYS[1])
local total, device, alive_dev = {}, {}, {}
local live = {}
local n = 0
for i = 1, #first, 2 do
  local e = first[i]
  local bits = tonumber(first[i + 1])
  total[e] = 1
  if bits % 2 == 1 then device[e] = 1; alive_dev[e] = true else device[e] = 0 end
  live[e] = true
  n = n + 1
end
local k = 2
while n > 0 and k <= #KEYS do
  local row = redis.call('HGETALL', KEYS[k])
  local here = {}
  for i = 1, #row, 2 do here[row[i]] = tonumber(row[i + 1]) end
  for e, _ in pairs(live) do
    local bits = here[e]
    if bits == nil then
      live[e] = nil
      n = n - 1
    else
      total[e] = total[e] + 1
      if alive_dev[e] and bits % 2 == 1 then device[e] = device[e] + 1 else alive_dev[e] = nil end
    end
  end
  k = k + 1
end
local out = {}
for e, t in pairs(total) do
  out[#out + 1] = e
  out[#out + 1] = t
  out[#out + 1] = device[e]
end
return out
"""
