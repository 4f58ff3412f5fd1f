"""What skyrl-gym's environments need outside the process, checked before any training.

- `text2sql`: `environment.skyrl_gym.text2sql.db_path` is a directory holding the SQLite database
  every row names (its `db_id` under the `data` set's folder, as skyrl-gym looks it up);
- `search`: a retrieval service answers at `environment.skyrl_gym.search.search_url` (one probe
  query, within `environment.skyrl_gym.search.timeout` seconds);
- `searchcode`: skyrl-gym builds its search tool with its own fixed URL (it reads no key), so the
  retriever must answer there, and its code tool runs `python -c`, so `python` must be on PATH;
- `llm_as_a_judge` (SkyRL's example registers an environment under that id; skyrl-gym has none):
  a server answers at `environment.skyrl_gym.llm_as_a_judge.base_url` when it is set (null is
  OpenAI's API, not probed);
- every environment: each row builds it (the columns it reads, the files it opens: skyrl-gym's own
  constructor is the check).

`lcb` runs the code it scores in local processes and `aime`, `gsm8k`, `gsm8k_multi_turn` need
nothing outside the process. A failure raises `SkyRLGymServiceError` (a RewardError) or, for one
row, DatasetError, naming the key or the row and what to do.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import urllib.error
import urllib.request
from typing import Any

from inflight.rewards import RewardError
from inflight.tasks.base import Problem
from inflight.tasks.dataset import DatasetError

GYM_KEY = "environment.skyrl_gym"
log = logging.getLogger(__name__)


class SkyRLGymServiceError(RewardError):
    """A service a skyrl-gym environment needs is missing (the message names the key to set)."""


def check_services(env_id: str | None, settings: Any) -> None:
    """Raise SkyRLGymServiceError when what `env_id` needs outside the process is missing."""
    if env_id == "text2sql":
        db_path = settings.env_config("text2sql").db_path
        if not os.path.isdir(db_path):
            raise SkyRLGymServiceError(
                f"{GYM_KEY}.text2sql.db_path={db_path!r} is not a directory: skyrl-gym's text2sql "
                "environment runs each row's SQL against the SQLite databases there; set it to the directory "
                "holding them (SkyRL's SkyRL-SQL data: spider/, bird/, SynSQL-2.5M/)"
            )
    elif env_id == "search":
        section = settings.env_config("search")
        if section.log_requests:
            log.info("probing the retriever at %s (topk %d)", section.search_url, section.topk)
        probe_retriever(
            section.search_url,
            section.timeout,
            f"{GYM_KEY}.search.search_url={section.search_url!r}",
            f"set {GYM_KEY}.search.search_url to its /retrieve URL",
            section.topk,
        )
    elif env_id == "searchcode":
        from skyrl_gym.tools import SearchToolGroup

        url = inspect.signature(SearchToolGroup.__init__).parameters["search_url"].default
        probe_retriever(
            url,
            30,
            f"skyrl-gym's searchcode environment searches {url!r} (a fixed URL: it reads "
            f"no {GYM_KEY}.search key)",
            "start the retriever at that address",
        )
        if shutil.which("python") is None:
            raise SkyRLGymServiceError(
                "skyrl-gym's searchcode environment runs its code tool as `python -c`, and "
                "there is no `python` on PATH: put one there"
            )
    elif env_id == "llm_as_a_judge":
        base_url = getattr(settings.env_config("llm_as_a_judge"), "base_url", None)
        if base_url:
            probe_server(base_url.rstrip("/") + "/models", f"{GYM_KEY}.llm_as_a_judge.base_url={base_url!r}")


def probe_retriever(url: str, timeout: float, where: str, fix: str, topk: int = 1) -> None:
    """One query to a Search-R1 retriever (`POST {"query", "topk", "return_scores"}` -> `{"result":
    [...]}`); raise SkyRLGymServiceError unless it answers with a result."""
    body = json.dumps({"query": "probe", "topk": topk, "return_scores": False}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            answer = json.loads(reply.read() or b"null")
        if not isinstance(answer, dict) or "result" not in answer:
            raise ValueError(f"it answered {str(answer)[:120]!r}, not a retriever's {{'result': [...]}}")
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise SkyRLGymServiceError(
            f"{where}: the search environment needs a retrieval service there and none answered "
            f"({type(err).__name__}: {reason}); start one (SkyRL's examples/train/search/retriever) or {fix}"
        ) from err


def probe_server(url: str, where: str, timeout: float = 10.0) -> None:
    """Raise SkyRLGymServiceError unless an HTTP server answers at `url` (any status: an OpenAI-style
    server may want a key for `GET /models`)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as err:
        raise SkyRLGymServiceError(
            f"{where}: the judge's OpenAI-compatible server does not answer at {url} "
            f"({type(err).__name__}: {getattr(err, 'reason', None) or err}); start it, "
            "or set the key to its base URL (null: OpenAI's)"
        ) from err


def check_row(maker: Any, problem: Problem) -> None:
    """Build (and close) the environment for `problem`; raise DatasetError naming the row on failure."""
    try:
        env = maker.build(problem)
    except Exception as err:
        hint, extras = "", problem.meta.get("extras") or {}
        if maker.env_id == "text2sql" and isinstance(err, FileNotFoundError):
            db_path = maker.settings.env_config("text2sql").db_path
            hint = (f"; {GYM_KEY}.text2sql.db_path={db_path!r} must hold the database the row names "
                    f"(db_id={extras.get('db_id')!r}, data={extras.get('data')!r})")
        elif maker.env_id == "text2sql" and isinstance(err, NotImplementedError):
            hint = (
                f"; its 'data' column ({extras.get('data')!r}) names no data set skyrl-gym's text2sql knows"
            )
        message = str(err) or type(err).__name__
        raise DatasetError(
            f"{problem.meta.get('source', problem.id)}: the skyrl-gym environment {maker.name!r} "
            f"cannot be built for this row ({type(err).__name__}: {message}){hint}"
        ) from err
    env.close()
