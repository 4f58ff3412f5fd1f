"""Evaluation: `inflight eval` (N samples per problem, scored, pass@k per data set, sample dumps) and
the runner the trainer's periodic evaluation shares with it."""

from inflight.eval.passk import mean_pass_at_k, pass_at_k, report_ks
from inflight.eval.run import EvalResult, eval_sets, evaluate, summarise

__all__ = ["EvalResult", "eval_sets", "evaluate", "mean_pass_at_k", "pass_at_k", "report_ks", "summarise"]
