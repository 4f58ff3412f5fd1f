"""Multi-turn tool episodes, token-in/token-out, against the tokenizer's own chat template.

The model's turns are scripted (a client that returns given token ids: the only fake, for the
sampling); everything else is real: the tiny model's BPE tokenizer and its Qwen2.5-style template,
`ToolEnv` calling a Python function, the generator. The reference is `apply_chat_template` over the
whole conversation (with the tools): wherever the model did not sample, the trajectory holds the
template's tokens (loss mask 0); where it did, its sampled ids verbatim (mask 1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from rl_support import mask_runs
from scripted_client import ScriptedClient

from inflight.rollout.task_generator import ENV_VERSION, TaskGenerator
from inflight.tasks.base import Problem, Task
from inflight.tasks.tool_env import ToolEnv, make_tool
from inflight.testing.tiny_model import make_tokenizer

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
PROMPT = [{"role": "user", "content": "What is 17 + 25? Use the tool."}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first one.
        b: The second one.
    """
    return a + b


class ToolTask(Task):
    """Chat prompts, `ToolEnv` episodes with the `add` tool, exact-match final answers."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.problem = Problem("p0", PROMPT, "42")

    def train_problems(self) -> Sequence[Problem]:
        return [self.problem]

    def eval_problems(self) -> Sequence[Problem]:
        return [self.problem]

    def reward(self, problem: Problem, response: str) -> float:
        return float(response.strip() == problem.answer)

    def make_env(self, problem: Problem) -> ToolEnv:
        return ToolEnv(problem, tools=[add], reward="exact", max_turns=4)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def template_ids(tok, messages, tools) -> list[int]:
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run(tok, turns, **kwargs):
    task = ToolTask(tok)
    client = ScriptedClient(turns)
    gen = TaskGenerator(client, task, n=1, max_tokens=64, max_turns=8, **kwargs)
    traj = asyncio.run(gen.episode(task.problem))
    return task, client, traj


def test_tool_episode_equals_the_template_rendering_where_the_model_did_not_sample(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    first, second = encode(tok, CALL) + [eos], encode(tok, "42") + [eos]
    task, client, traj = run(tok, [(first, "stop"), (second, "stop")])
    tools = [make_tool(add).schema]
    conversation = [*PROMPT,
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 17, "b": 25}}}]},
                    {"role": "tool", "name": "add", "content": "42"},
                    {"role": "assistant", "content": "42"}]
    expected = template_ids(tok, conversation, tools)
    full = traj.prompt_ids + traj.response_ids
    # the whole trajectory is the template's rendering, but for the "\n" it puts after the last turn
    assert full == expected[: len(full)] and tok.decode(expected[len(full):]) == "\n"
    assert traj.prompt_ids == template_ids(tok, PROMPT, tools) + encode(tok, "<|im_start|>assistant\n")
    assert "# Tools" in tok.decode(traj.prompt_ids) and '"name": "add"' in tok.decode(traj.prompt_ids)
    # sampled ids (both end-of-turn tokens included) have mask 1; the template's tokens mask 0
    runs = mask_runs(traj)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert runs[0][1] == first and runs[2][1] == second
    assert tok.decode(runs[1][1]) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                     "<|im_start|>assistant\n"
    env_at = [i for i, m in enumerate(traj.loss_mask) if m == 0]
    assert all(traj.versions[i] == ENV_VERSION and traj.logprobs[i] == 0.0 for i in env_at)
    assert all(traj.versions[i] == 7 and traj.logprobs[i] == -0.5 for i, m in enumerate(traj.loss_mask) if m)
    # the model saw exactly the trajectory so far (token-in/token-out)
    assert client.prompts == [
        traj.prompt_ids,
        traj.prompt_ids + traj.response_ids[: len(first) + len(runs[1][1])],
    ]
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.info["tool_calls"] == 1
    assert traj.num_generated == len(first) + len(second)


def test_sampled_ids_are_kept_verbatim_even_when_not_how_the_text_tokenizes(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    canonical = encode(tok, "the")
    by_char = [i for ch in "the" for i in encode(tok, ch)]
    assert len(canonical) == 1 and len(by_char) == 3  # the model sampled "t", "h", "e"
    task = ToolTask(tok)
    task.make_env = lambda p: ToolEnv(
        p, tools=[add], reward=lambda response, truth, **_: float(response == "the")
    )
    client = ScriptedClient([(encode(tok, CALL) + [eos], "stop"), (by_char + [eos], "stop")])
    traj = asyncio.run(TaskGenerator(client, task, n=1, max_tokens=64, max_turns=4).episode(task.problem))
    assert traj.response_ids[-4:] == by_char + [eos] and traj.loss_mask[-4:] == [1, 1, 1, 1]
    assert traj.reward == 1.0  # the environment saw the text "the"


def test_a_turn_ended_by_a_stop_string_gets_the_templates_end_of_turn_with_mask_0(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # the engine ran past the stop string (it stops on token ids only) until EOS
    first = encode(tok, CALL) + encode(tok, " and then some more words") + [eos]
    task, client, traj = run(
        tok, [(first, "stop"), (encode(tok, "42") + [eos], "stop")], stop=["</tool_call>"]
    )
    kept = encode(tok, CALL)
    runs = mask_runs(traj)
    assert runs[0] == (1, kept)  # up to the token that completed "</tool_call>"
    assert runs[1][1][0] == eos  # the model did not sample <|im_end|>: the template's, mask 0
    tools = [make_tool(add).schema]
    conversation = [*PROMPT, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "42"}]
    full = traj.prompt_ids + traj.response_ids
    assert full == template_ids(tok, conversation, tools)[: len(full)]
    # the stop string was dropped from the text (vLLM's default) and the tool call still ran
    assert traj.reward == 1.0 and traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == 0


def test_tool_errors_come_back_as_tool_messages_and_the_episode_goes_on(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    bad = ['<tool_call>\n{"name": "mul", "arguments": {"a": 1}}\n</tool_call>',
           '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2</tool_call>']
    turns = [(encode(tok, t) + [eos], "stop") for t in [*bad, "41"]]
    task, _, traj = run(tok, turns)
    text = tok.decode(traj.response_ids)
    assert "Error: unknown tool 'mul'" in text and "Error: bad arguments for 'add'" in text
    assert "Error: the tool call is not valid" in text
    assert traj.num_turns == 4 and traj.reward == 0.0 and traj.info["tool_errors"] == 3


def test_the_turn_limit_ends_an_episode_without_a_final_answer(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    task = ToolTask(tok)
    client = ScriptedClient([(encode(tok, CALL) + [eos], "stop")] * 3)
    gen = TaskGenerator(client, task, n=1, max_tokens=64)
    task.make_env = lambda p: ToolEnv(p, tools=[add], reward="exact")  # leaves the limit to the run
    for limit in (1, 2):
        client.turns = [(encode(tok, CALL) + [eos], "stop")] * 3
        gen.max_turns = limit
        traj = asyncio.run(gen.episode(task.problem))
        assert traj.num_turns == limit and traj.reward == 0.0 and traj.info["max_turns_reached"]
        assert traj.loss_mask[-1] == 1  # no observation appended after the last allowed turn
