"""Training agents you wrote, through an OpenAI-compatible endpoint served from the run's engines.

`AgentEndpoint` (endpoint.py) serves the server's routes per session, `SessionScope` (session.py)
records each call's exact tokens and continues a conversation from them, `merge_calls` (merge.py)
turns a session's calls into token-in/token-out samples, `AgentGenerator` (agent_generator.py) plays
episodes of your `agent(base_url, api_key, problem)` as trajectory groups, and `AgentRun` (run.py)
is what a trainer holds when `generator.agent.path` names an agent, or `environment.env_class` a
verifiers environment (`VerifiersAgent`, verifiers_env.py: an agent driving verifiers_worker.py in
verifiers' own venv).
"""

from inflight.agents.agent import AgentError, AgentStopped, load_agent
from inflight.agents.agent_generator import AgentGenerator
from inflight.agents.endpoint import AgentEndpoint
from inflight.agents.merge import Merged, Sample, merge_calls
from inflight.agents.records import CallRecord, ChatTurn
from inflight.agents.run import AgentRun, uses_agent
from inflight.agents.session import Session, SessionSampling
from inflight.agents.verifiers_env import VerifiersAgent, VerifiersError

__all__ = [
    "AgentEndpoint",
    "AgentError",
    "AgentGenerator",
    "AgentRun",
    "AgentStopped",
    "CallRecord",
    "ChatTurn",
    "Merged",
    "Sample",
    "Session",
    "SessionSampling",
    "VerifiersAgent",
    "VerifiersError",
    "load_agent",
    "merge_calls",
    "uses_agent",
]
