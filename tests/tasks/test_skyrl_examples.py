"""The environments SkyRL's example entry points register (`inflight.tasks.skyrl_examples`), by their
ids in rows as SkyRL's example datasets write them, played through `DataTask` and the generator."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from gym_support import ScriptedClient, encode, write_rows

from inflight.config import load_config
from inflight.config.implemented import unimplemented
from inflight.rollout.task_generator import TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.skyrl_examples import MultiplyEnv, first_boxed
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def multiply_rows(product: str = "42") -> list[dict]:
    """Rows as SkyRL's examples/train/multiply/multiply_dataset.py writes them."""
    return [{"data_source": "synthetic_multiply", "env_class": "multiply",
             "prompt": [{"role": "system", "content": "Put your final answer in \\boxed{answer} format."},
                        {"role": "user", "content": "6 * 7"}],
             "reward_spec": {"method": "rule", "ground_truth": product},
             "extra_info": {"num_digits": 1, "split": "train"}}] * 2


def play(task, tok, texts: list[str]):
    client = ScriptedClient([(encode(tok, t) + [tok.eos_token_id], "stop") for t in texts])
    return asyncio.run(
        TaskGenerator(client, task, n=1, max_tokens=64).episode(task.train_problems()[0])
    ), client


@pytest.mark.parametrize(("answer", "reward"), [("so \\boxed{42}.", 1.0), ("\\boxed{ 42 }", 1.0),
                                                ("\\boxed{41} or \\boxed{42}", 0.5), ("42", 0.0)])
def test_multiply_scores_the_first_boxed_answer_in_one_turn(tok, tmp_path, answer, reward):
    data = write_rows(tmp_path / "multiply.parquet", multiply_rows())
    task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(max_turns=1))
    assert task.report.rewards == {"multiply": 4}
    traj, _ = play(task, tok, [answer])
    assert traj.num_turns == 1 and traj.reward == reward


def test_multiply_gives_feedback_until_the_product_or_the_last_turn(tok, tmp_path):
    data = write_rows(tmp_path / "multiply.parquet", multiply_rows())
    task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(max_turns=3))
    traj, client = play(task, tok, ["it is 42", "\\boxed{40}", "\\boxed{42}", "never asked"])
    assert traj.num_turns == 3 and len(client.prompts) == 3  # the product ended the episode
    assert [r for _, r in traj.turn_rewards] == [0.0, 0.0, 1.0]  # earlier turns score 0
    first, second = (tok.decode(client.prompts[k][len(traj.prompt_ids):]) for k in (1, 2))
    assert "\\boxed{your_answer}" in first and "'40' is not the product" in second
    last, _ = play(task, tok, ["no", "\\boxed{1}", "\\boxed{2}"])
    assert last.num_turns == 3 and [r for _, r in last.turn_rewards] == [0.0, 0.0, 0.5]  # out of turns


def test_multiply_needs_the_ground_truth_and_defaults_to_five_turns():
    with pytest.raises(ValueError, match="reward_spec.ground_truth"):
        MultiplyEnv({}, {"reward_spec": {"method": "rule"}})
    env = MultiplyEnv({}, {"reward_spec": {"ground_truth": 6}})
    assert env.max_turns == 5
    assert [env.step("\\boxed{5}")["done"] for _ in range(5)] == [False] * 4 + [True]
    assert first_boxed("\\boxed{}") is None and first_boxed("\\boxed{12") is None


def test_skyrls_multiply_script_is_not_refused():
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=multiply"])
    assert unimplemented(cfg) == []


class Judge:
    """An OpenAI-compatible judge on a free local port (`POST /v1/chat/completions`) whose reply is
    `reply(predicted answer)`; records each request's body. Status 500 for `fail`."""

    def __init__(self, reply, fail: bool = False) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests, owner = [], self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                content = body["messages"][0]["content"]
                answer = content.rsplit("ANSWER TO GRADE:\n", 1)[-1]
                out = {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": reply(answer)}}]}
                self.send_response(500 if fail else 200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(out).encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def judge_rows() -> list[dict]:
    """Rows as SkyRL's examples/train/llm_as_a_judge/gsm8k_dataset_judge.py writes them."""
    return [{"data_source": "openai/gsm8k", "env_class": "llm_as_a_judge",
             "prompt": [{"role": "user", "content": "3 + 4? End with #### <number>."}],
             "reward_spec": {"method": "rule", "ground_truth": "3 + 4 = 7\n#### 7"}}] * 2


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("They agree.\n### Final Score: 1", 1.0),
        ("### Final Score: 0.0", 0.0),
        ("1", 1.0),
        ("looks right", 0.0),
    ],
)
def test_llm_as_a_judge_scores_what_the_judge_says(tok, tmp_path, monkeypatch, reply, reward):
    from inflight.config.schema.data import LLMJudgeConfig

    monkeypatch.setenv("OPENAI_API_KEY", "local")
    judge = Judge(lambda answer: reply)
    try:
        data = write_rows(tmp_path / "judge.parquet", judge_rows())
        section = LLMJudgeConfig(model="tiny-judge", base_url=judge.url)
        task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(SimpleNamespace(llm_as_a_judge=section)))
        traj, _ = play(task, tok, ["3 + 4 = 7\n#### 7"])
    finally:
        judge.close()
    assert traj.num_turns == 1 and traj.reward == reward and not traj.reward_failed
    (request,) = [r for r in judge.requests if r["messages"]]
    assert request["model"] == "tiny-judge"
    content = request["messages"][0]["content"]
    assert "3 + 4 = 7\n#### 7" in content.split("ANSWER TO GRADE:")[0] and content.endswith("#### 7")


def test_llm_as_a_judge_that_fails_is_a_reward_failure_and_the_key_is_required(tok, tmp_path, monkeypatch):
    from inflight.tasks.skyrl_examples import LLMJudgeEnv

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        LLMJudgeEnv(None, {"reward_spec": {"ground_truth": "#### 7"}})
    monkeypatch.setenv("OPENAI_API_KEY", "local")
    judge = Judge(lambda answer: "### Final Score: 1", fail=True)
    try:
        data = write_rows(tmp_path / "judge.parquet", judge_rows())
        section = SimpleNamespace(model="tiny-judge", base_url=judge.url)
        task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(SimpleNamespace(llm_as_a_judge=section)))
        traj, _ = play(task, tok, ["#### 7"])
    finally:
        judge.close()
    assert traj.reward == 0.0 and traj.reward_failed
