"""Shared pieces of the skyrl-gym environment tests: scripted model turns, SkyRL rows on disk, a tiny
SQLite database laid out as SkyRL-SQL's, and a local Search-R1 retriever over HTTP."""

from __future__ import annotations

import json
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets
from scripted_client import ScriptedClient, encode  # noqa: F401 (the tests import them from here)

datasets.disable_progress_bars()


def write_rows(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


SINGERS = [("Ann", 25), ("Bo", 41), ("Cy", 33), ("Di", 19)]


def make_spider_db(root: Path, db_id: str = "concert") -> Path:
    """`root/spider/database/<db_id>/<db_id>.sqlite` (where skyrl-gym's text2sql looks for spider's)
    with a `singer(name, age)` table; returns `root`."""
    folder = root / "spider" / "database" / db_id
    folder.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(folder / f"{db_id}.sqlite") as conn:
        conn.execute("CREATE TABLE singer (name TEXT, age INTEGER)")
        conn.executemany("INSERT INTO singer VALUES (?, ?)", SINGERS)
    return root


class Retriever:
    """A Search-R1 retriever (`POST /retrieve {"query", "topk", "return_scores"}` -> `{"result":
    [[{"document": {"contents"}, "score"}]]}`) over `docs`, on a free local port; records queries."""

    def __init__(self, docs: list[str]) -> None:
        self.docs, self.queries = docs, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.queries.append(body)
                words = set(body["query"].lower().split())
                hits = sorted(owner.docs, key=lambda d: -len(words & set(d.lower().split())))[: body["topk"]]
                reply = json.dumps({"result": [[{"document": {"contents": d}, "score": 1.0} for d in hits]]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port_url(path: str = "/retrieve") -> str:
    """A local URL nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"
