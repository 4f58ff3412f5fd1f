"""Rollouts: a task's episodes played through an inference client, as trajectory groups.

Below `train` (which trains on the groups) and `eval` (which scores them), above `tasks` and the
client protocol: the trainer and `inflight eval` play exactly the same episodes.
"""

from inflight.rollout.task_generator import TaskGenerator, Trajectory, TrajectoryGroup

__all__ = ["TaskGenerator", "Trajectory", "TrajectoryGroup"]
