"""Router: which server gets the next generation request.

Least outstanding requests, with session affinity: the first request of a session goes to the least
busy server and later ones follow it, so a multi-turn trajectory finds its prefix in that server's
cache. A server that refused a connection is avoided for `down_cooldown_s`.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence


class Router:
    """Picks a server URL per request; `acquire`/`release` keep the outstanding counts."""

    def __init__(
        self, urls: Sequence[str], max_sessions: int = 100_000, down_cooldown_s: float = 5.0
    ) -> None:
        if not urls:
            raise ValueError("Router needs at least one server URL")
        self.urls = list(urls)
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.max_sessions = max_sessions
        self.down_cooldown_s = down_cooldown_s
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()

    def pick(self, session_id: str | None = None, avoid: Collection[str] = ()) -> str:
        """The session's server if it has one and it is usable, else the least busy usable one."""
        now = time.monotonic()
        usable = [u for u in self.urls if u not in avoid and self._down_until.get(u, 0.0) <= now]
        if not usable:  # everything is down or avoided: try the ones not avoided anyway
            usable = [u for u in self.urls if u not in avoid] or list(self.urls)
        if session_id is not None:
            url = self._sessions.get(session_id)
            if url in usable:
                self._sessions.move_to_end(session_id)
                return url
        start = next(self._turn) % len(usable)  # rotate among equally busy servers
        rotated = usable[start:] + usable[:start]
        url = min(rotated, key=lambda u: self.outstanding[u])
        if session_id is not None:
            self._sessions[session_id] = url
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return url

    def acquire(self, url: str) -> None:
        self.outstanding[url] += 1

    def release(self, url: str) -> None:
        self.outstanding[url] -= 1

    def mark_down(self, url: str) -> None:
        """Avoid `url` for a while (it refused a connection)."""
        self._down_until[url] = time.monotonic() + self.down_cooldown_s

    def mark_up(self, url: str) -> None:
        self._down_until.pop(url, None)

    def session_server(self, session_id: str) -> str | None:
        return self._sessions.get(session_id)
