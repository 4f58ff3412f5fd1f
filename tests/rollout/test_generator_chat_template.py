"""`generator.chat_template` (a Jinja file, SkyRL's names) and `generator.chat_template_kwargs`: every
rendering of the run's messages (the prompts, the tokens between turns) goes through that template
with those arguments, against the tokenizer's own `apply_chat_template(chat_template=...,
**kwargs)`; `qwen3_with_thinking` writes what SkyRL's template of that name writes; what cannot
work is refused at start-up naming the key."""

from __future__ import annotations

import asyncio

import pytest
import skyrl_gym
from scripted import ScriptedClient, encode, skyrl_rows, write_parquet
from skyrl_oracle import import_skyrl

from inflight.chat.templates import resolve_chat_template
from inflight.chat.turns import ChatFormat, ChatTemplateError
from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.rollout.task_generator import TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.dataset import DatasetError
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer
from inflight.train.data_setup import chat_format, check_data_job

# a template of the user's: its own markers, and an argument (`style`) that changes what it writes
TEMPLATE = (
    "{%- for m in messages %}[{{ m['role'] }}|{{ style | default('plain') }}]{{ m['content'] }}<|im_end|>"
    "{%- endfor %}{%- if add_generation_prompt %}[assistant|{{ style | default('plain') }}]{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def rendered_ids(tok, messages, add_generation_prompt=True, **kwargs) -> list[int]:
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return encode(tok, text)


def test_a_template_file_and_its_arguments_render_prompts_and_turns(tok, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    cfg = load_config(None, [*LOCAL_CPU, "generator.chat_template.source=file",
                             f"generator.chat_template.name_or_path={path}",
                             "generator.chat_template_kwargs={style: bold}"])
    fmt = chat_format(cfg)
    assert fmt == ChatFormat(TEMPLATE, {"style": "bold"})
    data = write_parquet(tmp_path / "d.parquet", skyrl_rows("gsm8k_multi_turn", n=2))
    task = DataTask(tok, [data], [data], chat_format=fmt, skyrl_gym=GymSettings(None, 2))
    problem = task.train_problems()[0]
    kwargs = {"chat_template": TEMPLATE, "style": "bold"}
    assert problem.meta["prompt_tokens"] == len(rendered_ids(tok, problem.prompt, **kwargs))
    eos = tok.eos_token_id
    client = ScriptedClient(
        [(encode(tok, "so #### 3") + [eos], "stop"), (encode(tok, "#### 1") + [eos], "stop")]
    )
    traj = asyncio.run(TaskGenerator(client, task, n=1, max_tokens=16).episode(problem))
    assert traj.num_turns == 2
    history = [*problem.prompt, {"role": "assistant", "content": "so #### 3"}]
    first = rendered_ids(tok, problem.prompt, **kwargs)
    assert client.prompts[0] == first and tok.decode(first).endswith("[assistant|bold]")
    # the second turn's input: the first, the sampled turn (its own <|im_end|>), then the template's
    # tokens for the environment's message (skyrl-gym's, stepped by hand) with the same arguments
    env = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras=problem.meta["extras"] | {"max_turns": 2})
    env.init(problem.prompt)
    message = env.step("so #### 3")["observations"]
    assert client.prompts[1] == rendered_ids(tok, [*history, *message], **kwargs)
    assert tok.decode(client.prompts[1]).endswith("<|im_end|>[assistant|bold]")


def test_qwen3_with_thinking_writes_what_skyrls_template_of_that_name_writes(tok):
    skyrl = import_skyrl("skyrl.train.generators.utils").CUSTOM_CHAT_TEMPLATES["qwen3_with_thinking"]
    ours = resolve_chat_template("name", "qwen3_with_thinking")
    chat = [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>add again</think>\n\n6"},
    ]
    for upto in (2, 3, 4, 5):
        want = tok.apply_chat_template(chat[:upto], tokenize=False, chat_template=skyrl)
        assert tok.apply_chat_template(chat[:upto], tokenize=False, chat_template=ours) == want
    # SkyRL's lacks the generation prompt; ours writes Qwen3's (and its empty think block when asked)
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, chat_template=ours, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    off = tok.apply_chat_template(chat[:2], tokenize=False, chat_template=ours, add_generation_prompt=True,
                                  enable_thinking=False)
    assert off == prompt + "<think>\n\n</think>\n\n"


def test_what_cannot_work_is_refused_naming_the_key(tok, tmp_path):
    with pytest.raises(ChatTemplateError, match=r"name_or_path='qwen3_without_thinking' is not available.*"
                                                r"token-in/token-out"):
        resolve_chat_template("name", "qwen3_without_thinking")
    with pytest.raises(ChatTemplateError, match=r"'chatml' is not a chat template name: SkyRL's names are "
                                                r"qwen3_with_thinking, qwen3_without_thinking"):
        resolve_chat_template("name", "chatml")
    with pytest.raises(ChatTemplateError, match=r"no such file"):
        resolve_chat_template("file", str(tmp_path / "missing.jinja"))
    assert resolve_chat_template("file", None) is None and resolve_chat_template("name", None) is None
    with pytest.raises(ChatTemplateError, match=r"\['tools'\] are set by the rendering itself"):
        ChatFormat(None, {"tools": []})
    data = write_parquet(tmp_path / "d.parquet", [{"prompt": "hi", "answer": "1"}] * 2)
    untemplated = make_tokenizer()
    untemplated.chat_template = None
    with pytest.raises(DatasetError, match=r"chat_template_kwargs is set, but no chat template renders"):
        DataTask(untemplated, [data], [data], chat_format=ChatFormat(None, {"enable_thinking": False}))
    # a built-in task renders no chat template: the keys are refused, not ignored
    cfg = load_config(None, [*LOCAL_CPU, "generator.chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(Exception, match=r"generator.chat_template_kwargs.*built-in task 'addition'"):
        check_data_job(cfg, JobConfig(task="addition"))
