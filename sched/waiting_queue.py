"""The waiting requests, taken in the policy's rank order without ranking them all every step.

A rank changes with time (aging), so a sorted list must be re-ranked and re-sorted every step:
milliseconds at thousands waiting. But a policy can say, per request, under which keys it sorts in
a few heaps such that the best-ranked waiting request, at any time, is the head of one of them
(`Policy.heap_keys`): the priority policy keeps requests that never ran in one heap by arrival
(the oldest are the ones starving) and one by a time-free form of their score, and preempted
requests, whose rank no longer changes, in a third. Taking requests in rank order is then a merge
of a few heap heads by their actual rank: each step ranks only the requests it looks at.

Removal is lazy (an entry whose request left or was re-added is dropped when it surfaces), so it
costs O(1); the heaps are rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from mm_engine.request import Request
from mm_engine.sched.policy import Policy


class WaitingQueue:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._heaps: dict[str, list[tuple]] = {}  # heap name -> [(key, version, request)]
        self._members: dict[str, tuple[int, Request]] = {}  # request id -> (version, request)
        self._versions = itertools.count()
        self._entries = 0

    def add(self, req: Request) -> None:
        version = next(self._versions)
        self._members[req.request_id] = (version, req)
        for name, key in self.policy.heap_keys(req):
            heapq.heappush(self._heaps.setdefault(name, []), (key, version, req))
            self._entries += 1
        if self._entries > 4 * len(self._members) + 64:
            self._compact()

    def remove(self, req: Request) -> None:
        self._members.pop(req.request_id, None)

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        return (req for _, req in list(self._members.values()))

    def __contains__(self, req: Request) -> bool:
        member = self._members.get(req.request_id)
        return member is not None and member[1] is req

    def in_rank_order(self, now: float) -> Iterator[Request]:
        """Waiting requests, best rank first at `now`, taken lazily. Requests may be added or
        removed meanwhile; what the iteration took off the heaps goes back when it is closed."""
        taken: list[tuple[str, tuple]] = []
        seen: set[str] = set()
        try:
            while True:
                best: tuple | None = None
                for name, heap in self._heaps.items():
                    head = self._head(name, heap, seen, taken)
                    if head is not None:
                        rank = self.policy.rank(head, now)
                        if best is None or rank < best[0]:
                            best = (rank, name)
                if best is None:
                    return
                entry = heapq.heappop(self._heaps[best[1]])
                taken.append((best[1], entry))
                seen.add(entry[2].request_id)
                yield entry[2]
        finally:
            for name, entry in taken:
                member = self._members.get(entry[2].request_id)
                if member is not None and member[0] == entry[1]:
                    heapq.heappush(self._heaps[name], entry)
                else:
                    self._entries -= 1

    def _head(self, name: str, heap: list, seen: set[str], taken: list) -> Request | None:
        while heap:
            _, version, req = heap[0]
            member = self._members.get(req.request_id)
            if member is None or member[0] != version:  # gone, or re-added under a new version
                heapq.heappop(heap)
                self._entries -= 1
            elif req.request_id in seen:  # taken already through another heap
                taken.append((name, heapq.heappop(heap)))
            else:
                return req
        return None

    def _compact(self) -> None:
        for name, heap in self._heaps.items():
            live = [e for e in heap if self._members.get(e[2].request_id, (None,))[0] == e[1]]
            heapq.heapify(live)
            self._heaps[name] = live
        self._entries = sum(len(h) for h in self._heaps.values())
