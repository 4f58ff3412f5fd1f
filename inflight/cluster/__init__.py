"""Ray orchestration: the engines and the policy ranks as Ray actors with placement (colocated or
not), a local Ray instance by default or an existing cluster (`job.ray_address`, `--ray-address`).

Everything here wraps plain classes that also run without Ray (`inflight.train`); importing this
package needs `ray` installed (`pip install torch==2.13.0 -e '.[ray]'`).
"""

from inflight.cluster.actors import EngineActor, PolicyActor, RayEngineClient, RayPolicy
from inflight.cluster.placement import Placement, make_placement, plan_bundles, required_cpus
from inflight.cluster.trainer import RayFullyAsyncTrainer, RaySyncTrainer, init_ray, make_ray_trainer
from inflight.train.trainer import policy_ranks

__all__ = [
    "EngineActor",
    "Placement",
    "PolicyActor",
    "RayEngineClient",
    "RayFullyAsyncTrainer",
    "RayPolicy",
    "RaySyncTrainer",
    "init_ray",
    "make_placement",
    "make_ray_trainer",
    "plan_bundles",
    "policy_ranks",
    "required_cpus",
]
