"""The router side of the directory: live workers and longest cached prefixes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.directory.records import (
    ROLES,
    DirectoryError,
    DirectoryKeys,
    WorkerRecord,
    as_str,
    logger,
    make_member,
)

# Atomically drop (block key, member) pairs whose worker lease is gone or carries another
# generation. KEYS[i] is a block key, ARGV[1] the worker-key prefix, ARGV[i+1] the member.
_REMOVE_STALE_LUA = """
local removed = 0
for i, key in ipairs(KEYS) do
  local member = ARGV[i + 1]
  local sep = string.find(member, ":[^:]*$")
  if sep then
    local cur = redis.call('HGET', ARGV[1] .. string.sub(member, 1, sep - 1), 'generation')
    if cur ~= string.sub(member, sep + 1) then
      removed = removed + redis.call('SREM', key, member)
    end
  end
end
return removed
"""
# One step of the janitor's pass, server-side: SCAN from ARGV[1] (MATCH ARGV[2], COUNT ARGV[3]),
# then drop each member of the keys found whose worker lease (ARGV[4] .. worker id) is gone or
# carries another generation, each worker's lease read once. Returns {next cursor, removed}:
# the router parses two values however many keys the step visits, where reading every member
# set back (a pipeline of SMEMBERS) held its event loop for milliseconds a step.
_SWEEP_LUA = """
local scan = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local gens = {}
local removed = 0
for _, key in ipairs(scan[2]) do
  for _, member in ipairs(redis.call('SMEMBERS', key)) do
    local sep = string.find(member, ":[^:]*$")
    if sep then
      local wid = string.sub(member, 1, sep - 1)
      local cur = gens[wid]
      if cur == nil then
        cur = redis.call('HGET', ARGV[4] .. wid, 'generation')
        gens[wid] = cur
      end
      if cur ~= string.sub(member, sep + 1) then
        removed = removed + redis.call('SREM', key, member)
      end
    end
  end
end
return {scan[1], removed}
"""
# Longest cached prefix per live member, scanned server-side: KEYS = the chain's block keys in
# order, ARGV = live members. Stops at the first block no still-matching member holds. Returns
# {member, count, ...} for members with count > 0, then "", then up to 256 (key, member) pairs
# of members seen that are not live (stale: expired lease or older generation).
_PREFIX_MATCH_LUA = """
local live, active = {}, {}
local n_active = 0
for i = 1, #ARGV do live[ARGV[i]] = true; active[ARGV[i]] = 0; n_active = n_active + 1 end
local stale = {}
for i, key in ipairs(KEYS) do
  if n_active == 0 then break end
  local holders = {}
  for _, m in ipairs(redis.call('SMEMBERS', key)) do
    if live[m] then holders[m] = true
    elseif #stale < 512 then stale[#stale + 1] = key; stale[#stale + 1] = m end
  end
  for m, c in pairs(active) do
    if holders[m] and c == i - 1 then active[m] = i
    elseif c == i - 1 then n_active = n_active - 1 end
  end
end
local out = {}
for m, c in pairs(active) do
  if c > 0 then out[#out + 1] = m; out[#out + 1] = c end
end
out[#out + 1] = ""
for _, x in ipairs(stale) do out[#out + 1] = x end
return out
"""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`DirectoryReader.prefix_match`."""

    blocks: dict[str, int]  # worker_id -> number of leading prompt blocks it holds
    stale: list[tuple[str, str]]  # (block key, member) pairs seen that no live worker owns


class DirectoryReader:
    """Async reads for the router: live workers and longest cached prefixes.

    ``client`` is a ``redis.asyncio.Redis`` (see :func:`connect_async`). Methods raise
    ``redis.RedisError``/``OSError`` when Redis is unreachable; the caller decides the fallback.
    """

    def __init__(self, client: aioredis.Redis, keys: DirectoryKeys | None = None) -> None:
        self.client = client
        self.keys = keys or DirectoryKeys()
        self._remove_stale = client.register_script(_REMOVE_STALE_LUA)
        self._prefix_match = client.register_script(_PREFIX_MATCH_LUA)
        self._sweep = client.register_script(_SWEEP_LUA)

    async def live_workers(self, roles: Iterable[str] = ROLES) -> list[WorkerRecord]:
        """Every worker whose lease exists, in the given roles (two round trips).

        Ids left in a role set after their lease expired are removed from the set.
        """
        roles = list(roles)
        pipe = self.client.pipeline(transaction=False)
        for role in roles:
            pipe.smembers(self.keys.workers(role))
        id_sets = await pipe.execute()
        ids = [(role, as_str(w)) for role, members in zip(roles, id_sets) for w in sorted(members)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for _, wid in ids:
            pipe.hgetall(self.keys.worker(wid))
        hashes = await pipe.execute()
        out: list[WorkerRecord] = []
        dead: list[tuple[str, str]] = []
        for (role, wid), h in zip(ids, hashes):
            if not h or "generation" not in {as_str(k) for k in h}:
                dead.append((role, wid))
                continue
            try:
                rec = WorkerRecord.from_hash(wid, h)
            except DirectoryError as e:
                logger.warning("%s", e)
                continue
            if rec.info.role == role:
                out.append(rec)
        if dead:
            pipe = self.client.pipeline(transaction=False)
            for role, wid in dead:
                pipe.srem(self.keys.workers(role), wid)
            await pipe.execute()
        return out

    async def prefix_match(
        self, model: str, block_hashes: Sequence[bytes], live: Mapping[str, str]
    ) -> PrefixMatch:
        """Leading prompt blocks held by each live worker (``live``: worker_id -> generation).

        One round trip: a server-side script reads the member set of each chained hash in
        order and stops at the first block that no still-matching live worker holds (so a miss
        costs one SMEMBERS however long the prompt). Members of unknown workers or stale
        generations are ignored and returned in ``stale`` (at most 256, up to the stop).
        """
        counts = dict.fromkeys(live, 0)
        if not block_hashes or not live:
            return PrefixMatch(counts, [])
        members = {make_member(wid, gen): wid for wid, gen in live.items()}
        reply = await self._prefix_match(
            keys=[self.keys.block(model, h) for h in block_hashes], args=list(members)
        )
        reply = [as_str(x) for x in reply]
        sep = reply.index("")
        for i in range(0, sep, 2):
            counts[members[reply[i]]] = int(reply[i + 1])
        stale = [(reply[i], reply[i + 1]) for i in range(sep + 1, len(reply) - 1, 2)]
        return PrefixMatch(counts, stale)

    async def remove_stale(self, pairs: Sequence[tuple[str, str]]) -> int:
        """SREM each (block key, member) whose lease is gone or of another generation.

        Re-checked inside one Lua script, so a member of a live incarnation is never removed.
        Returns the number removed.
        """
        if not pairs:
            return 0
        return int(
            await self._remove_stale(
                keys=[k for k, _ in pairs], args=[self.keys.worker("")] + [m for _, m in pairs]
            )
        )

    async def sweep(self, model: str, cursor: int = 0, count: int = 1000) -> tuple[int, int]:
        """Clean stale members from about ``count`` block keys; returns (next cursor, removed).

        Call repeatedly with the returned cursor (0 = a full pass finished). Bounded work per
        call, for a periodic janitor; one script call, done inside Redis (the same check as
        :meth:`remove_stale`, atomically).
        """
        next_cursor, removed = await self._sweep(
            args=[cursor, self.keys.block_pattern(model), count, self.keys.worker("")]
        )
        return int(next_cursor), int(removed)
