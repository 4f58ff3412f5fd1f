"""The training step's torch threads and the engines' lent to it: a lending that starts or ends
while a step runs takes effect at the step's next module (forward) or module-input gradient
(backward), on the training thread only; the split of `job.threads` / `job.engine_threads` per
trainer; the staleness window says when generation is ahead."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from inflight.config import ConfigError
from inflight.config.job import JobConfig
from inflight.orchestration.engine_memory import parameter_count
from inflight.orchestration.thread_lending import (
    LEND_MIN_PARAMETERS,
    ThreadLending,
    ThreadSplit,
    thread_split,
)
from inflight.train.staleness import StalenessManager


class _Probe(torch.autograd.Function):
    """Identity that records the torch threads its forward and backward compute with."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        log.append(("forward", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("backward", torch.get_num_threads()))
        return grad, None


class _Layer(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.linear, self.log = torch.nn.Linear(4, 4), log

    def forward(self, x):
        return _Probe.apply(self.linear(x), self.log)


def _step(lending: ThreadLending, log: list, lend_at_layer: int, give_back_in_backward: bool) -> int:
    layers = torch.nn.Sequential(*[_Layer(log) for _ in range(3)])
    layers[lend_at_layer].register_forward_pre_hook(lambda *_: lending.lend(True))
    if give_back_in_backward:  # the last layer's gradient is the first the backward computes
        def give_back_on_gradient(_module, _args, out):
            out.register_hook(lambda _grad: lending.lend(False))

        layers[2].register_forward_hook(give_back_on_gradient)

    def step():
        layers(torch.randn(2, 4, requires_grad=True)).sum().backward()
        return torch.get_num_threads()

    return lending.run(step, follow=True)


def test_a_lending_that_starts_mid_step_reaches_the_next_module_and_ends_in_the_backward():
    lending, log = ThreadLending(1, 1), []
    with ThreadPoolExecutor(1) as pool:  # a fresh thread: its torch threads are its own
        last = pool.submit(_step, lending, log, 1, True).result()
    forward = [n for kind, n in log if kind == "forward"]
    backward = [n for kind, n in log if kind == "backward"]
    # layer 1's own pre-hook lends after the global hook applied 1 thread: its first submodule
    # (the Linear) computes with 2 already
    assert forward == [1, 2, 2]
    # the give-back runs on the last layer's output gradient: the next module-input gradients use 1
    assert backward[0] in (1, 2) and backward[1:] == [1, 1]
    assert last == 1 and lending.seen == [1, 2]


def test_without_follow_the_step_keeps_the_threads_it_started_with():
    lending, log = ThreadLending(1, 1), []

    def run():
        layers = torch.nn.Sequential(*[_Layer(log) for _ in range(2)])
        layers[1].register_forward_pre_hook(lambda *_: lending.lend(True))
        return lending.run(lambda: layers(torch.randn(2, 4)).sum().item())

    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()
    assert [n for _, n in log] == [1, 1] and lending.seen == [1]


def test_other_threads_keep_their_threads_while_a_step_follows():
    lending, seen_elsewhere = ThreadLending(1, 1), []
    lending.lend(True)
    other = torch.nn.Linear(4, 4)

    def elsewhere():  # a module forward on another thread while the step's hook is registered
        torch.set_num_threads(1)
        other(torch.randn(1, 4))
        seen_elsewhere.append(torch.get_num_threads())

    def step():
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        return torch.get_num_threads()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lending.run, step, follow=True).result() == 2
    assert seen_elsewhere == [1]


def test_a_thread_split_must_have_threads():
    with pytest.raises(ValueError, match="not a thread split"):
        ThreadLending(0)


def _split(fully_async: bool, engines: int = 1, lend: bool = True, threads: int = 1, engine_threads: int = 1,
           engines_here: bool = True) -> ThreadSplit:
    cfg = SimpleNamespace(generator=SimpleNamespace(inference_engine=SimpleNamespace(num_engines=engines)),
                          trainer=SimpleNamespace(fully_async=SimpleNamespace(enabled=fully_async)))
    job = SimpleNamespace(threads=threads, engine_threads=engine_threads, lend_threads=lend)
    return thread_split(cfg, job, engines_here)


def test_the_synchronous_trainer_gives_every_core_to_the_phase_that_runs():
    split = _split(fully_async=False)
    assert split == ThreadSplit(trainer=1, engine=2, lendable=1, follow=False)
    lending = split.lending()
    assert lending.lent and lending.wanted == 2
    # two engines share the trainer's threads; every engine's own are lent to the step
    assert _split(fully_async=False, engines=2, threads=2) == ThreadSplit(2, 2, 2, False, engines=2)


def test_the_fully_async_trainer_follows_the_lending():
    split = _split(fully_async=True)
    assert split == ThreadSplit(1, 1, 1, follow=True)
    assert not split.lending().lent


@pytest.mark.parametrize("kwargs", [{"lend": False}, {"lend": False, "engines_here": False}])
def test_no_lending_when_off(kwargs):
    for fully_async in (False, True):
        assert _split(fully_async, **kwargs) == ThreadSplit(1, 1)


def test_lending_the_threads_of_http_servers_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="job.lend_threads"):
        _split(fully_async=True, engines_here=False)


def test_lending_with_ray_is_a_violation_of_the_job():
    assert [v.key for v in JobConfig(lend_threads=True, ray=True).validate()] == ["job.lend_threads"]
    assert JobConfig(lend_threads=True).validate() == []


def test_generation_is_ahead_only_when_the_window_is_full_and_nothing_runs():
    manager = StalenessManager(max_staleness_steps=0, mini_batch_size=2, max_concurrency=4)
    ahead = []
    manager.on_change = lambda: ahead.append(manager.generation_ahead)
    assert manager.try_start() and manager.try_start() and not manager.try_start()
    manager.accept()
    manager.accept()  # the window's two groups are in: nothing may start until the step
    manager.step_done()
    assert ahead == [False, False, False, True, False]


def _auto(model_dir, engines_here: bool = True, ray: bool = False, fully_async: bool = True) -> ThreadSplit:
    cfg = SimpleNamespace(generator=SimpleNamespace(inference_engine=SimpleNamespace(num_engines=1)),
                          trainer=SimpleNamespace(fully_async=SimpleNamespace(enabled=fully_async),
                                                  policy=SimpleNamespace(model=SimpleNamespace(path=model_dir))))
    job = SimpleNamespace(threads=1, engine_threads=1, lend_threads=None, ray=ray, ray_address=None)
    return thread_split(cfg, job, engines_here)


def test_the_parameter_count_is_transformers_own(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("llama")
    assert parameter_count(model_dir) == hf_model_factory(model_dir).num_parameters()
    assert parameter_count(None) is None


def test_null_lends_from_the_size_that_pays_on(tiny_model_factory, hf_model_factory):
    small = tiny_model_factory("qwen2")
    assert hf_model_factory(small).num_parameters() < LEND_MIN_PARAMETERS
    assert _auto(small) == ThreadSplit(1, 1)
    # a vocabulary of 40k x hidden 256 (tied) is over the bound: the fully-async steps follow the lending
    large = tiny_model_factory("qwen2", vocab_size=40_000, hidden_size=256)
    assert hf_model_factory(large).num_parameters() >= LEND_MIN_PARAMETERS
    assert _auto(large) == ThreadSplit(1, 1, 1, follow=True)
    assert _auto(large, fully_async=False) == ThreadSplit(1, 2, 1)
    # never where the threads are not the run's to lend (and no refusal: nobody asked for it)
    assert _auto(large, engines_here=False) == ThreadSplit(1, 1)
    assert _auto(large, ray=True) == ThreadSplit(1, 1)
    assert _auto(None) == ThreadSplit(1, 1)
