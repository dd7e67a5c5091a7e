"""Every Redis key of the mesh, and the one server-side script that reads them per request.

Layout (kept current by the index service from KV events):
- `hc:page:{page_hash}`      HASH  engine_id -> tier bits (1 device, 2 host)
- `hc:store:{store_id}:{page_hash}` STRING "1", with a TTL (`STORE_TTL_S`): the page is in
                             external store `store_id` (engines that announce that id
                             share it). Stores outlive engines and evict on their own, so
                             these expire instead of being removed.
- `hc:engine:{id}:pages`     SET   page hashes the engine holds (to clear it at once)
- `hc:engine:{id}:meta`      HASH  epoch, seq, bucket, namespace
- `hc:engine:{id}:alive`     STRING epoch, with a TTL refreshed by heartbeats
- `hc:engines`               SET   engine ids the index knows
- `hc:index:synced`          STRING run id of the server the index last resynced
                             (`bus_schemas/sentinel.py`: routers behind Sentinel trust a
                             server only when it matches)
Page hashes already cover namespace and cache_salt (see page_hash.py), so one key space
serves every namespace without mixing them.
"""

from __future__ import annotations

from collections.abc import Sequence

DEVICE_BIT = 1
HOST_BIT = 2
TIER_BITS = {"device": DEVICE_BIT, "host": HOST_BIT}

ENGINES = "hc:engines"
PAGE_PREFIX = "hc:page:"
STORE_PREFIX = "hc:store:"
STORE_TTL_S = 24 * 3600
HASH_HEX_LEN = 32  # page_hash.DIGEST_SIZE bytes as hex


def page(page_hash: str) -> str:
    return PAGE_PREFIX + page_hash


def store_page(store_id: str, page_hash: str) -> str:
    return f"{STORE_PREFIX}{store_id}:{page_hash}"


def engine_pages(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:pages"


def engine_meta(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:meta"


def engine_alive(engine_id: str) -> str:
    return f"hc:engine:{engine_id}:alive"


# ARGV[1]: the hex page hashes of one prompt, in order, concatenated (HASH_HEX_LEN chars
# each; `lookup_argv`); ARGV[2..]: store ids to look up. Returns a flat array [engine_id,
# prefix_pages, device_prefix_pages, ...]: for every engine holding the first page, how many
# leading pages it holds in any tier, and how many of those on the device; then, for every
# store id holding the first page, ["@" .. store_id, prefix_pages, 0] (STORE_MARK).
#
# An engine's pages are prefix-closed per tier: its radix tree holds a node on a tier only if
# the node's parent is there too (`RadixTree.check_integrity`), and the index applies each
# event batch, or snapshot, whole. So along one prompt's chain an engine holds pages
# [0, held) and has pages [0, device) on the device, and both lengths are found by binary
# search: O(engines x log pages) reads instead of one per page (512 at 32K tokens, page 64),
# and the last page is read first, so a whole-prompt hit costs two reads. Key names are built
# here from one argument instead of 512 KEYS: sending and parsing the keys cost more than
# the reads (standalone Redis/Valkey; a cluster would need them declared). Should the index
# ever hold a hole (it cannot, short of a bug), an engine's count lands somewhere in it: a
# routing hint off by some pages, never a wrong KV (each engine matches its own tree).
PREFIX_LOOKUP_LUA = (
    """
local blob, w = ARGV[1], $WIDTH
if #blob % w ~= 0 then return redis.error_reply('page hashes must be $WIDTH hex chars each') end
local n = #blob / w
local function key(k) return '$PREFIX' .. string.sub(blob, (k - 1) * w + 1, k * w) end
if n == 0 then return {} end
local out = {}
for s = 2, #ARGV do  -- stores: the pages they hold, by binary search (prefix-closed too)
  local id = ARGV[s]
  local function stored(k) return redis.call('EXISTS', '$STORE' .. id .. ':' .. string.sub(blob, (k - 1) * w + 1, k * w)) == 1 end
  if stored(1) then
    local lo, hi = 1, n
    if stored(n) then lo = n end
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if stored(mid) then lo = mid else hi = mid - 1 end
    end
    out[#out + 1] = '@' .. id
    out[#out + 1] = lo
    out[#out + 1] = 0
  end
end
local first = redis.call('HGETALL', key(1))
if #first == 0 then return out end
local last = {}
if n > 1 then
  local row = redis.call('HGETALL', key(n))
  for i = 1, #row, 2 do last[row[i]] = tonumber(row[i + 1]) end
end
-- the largest k in [lo, hi] with page k held by e (on the device when `device`); page lo
-- is known to be
local function longest(e, lo, hi, device)
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local bits = redis.call('HGET', key(mid), e)
    if bits and ((not device) or tonumber(bits) % 2 == 1) then lo = mid else hi = mid - 1 end
  end
  return lo
end
for i = 1, #first, 2 do
  local e = first[i]
  local top = last[e]
  local held, device = n, 0
  if n > 1 and top == nil then held = longest(e, 1, n - 1, false) end
  if tonumber(first[i + 1]) % 2 == 1 then
    if held == n and (n == 1 or top % 2 == 1) then device = n
    else device = longest(e, 1, held, true) end
  end
  out[#out + 1] = e
  out[#out + 1] = held
  out[#out + 1] = device
end
return out
""".replace("$WIDTH", str(HASH_HEX_LEN))
    .replace("$PREFIX", PAGE_PREFIX)
    .replace("$STORE", STORE_PREFIX)
)
STORE_MARK = "@"  # a lookup result entry about a store, not an engine


def lookup_argv(page_hashes: Sequence[str] | str, store_ids: Sequence[str] = ()) -> list[str]:
    """The ARGV of `PREFIX_LOOKUP_LUA` (no KEYS) for a prompt's hex page hashes, one per item
    or already concatenated, and the stores to look up."""
    blob = page_hashes if isinstance(page_hashes, str) else "".join(page_hashes)
    return [blob, *store_ids]
