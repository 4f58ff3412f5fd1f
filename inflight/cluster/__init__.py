"""Ray orchestration: the engines and the policy ranks as Ray actors with placement (colocated or
not), a local Ray instance by default or an existing cluster (`job.ray_address`, `--ray-address`).
`start_ray` is the runtime the trainers run on (`make_trainer(cfg, job, task, start=start_ray)`).

Everything here wraps plain classes that also run without Ray (`inflight.train`); importing this
package needs `ray` installed (`pip install torch==2.13.0 -e '.[ray]'`).
"""

from inflight.cluster.actors import EngineActor, PolicyActor, RayEngineClient, RayPolicy
from inflight.cluster.placement import Placement, make_placement, plan_bundles, required_cpus
from inflight.cluster.runtime import RayRuntime, init_ray, start_ray
from inflight.orchestration.engines import policy_ranks

__all__ = [
    "EngineActor", "Placement", "PolicyActor", "RayEngineClient", "RayPolicy", "RayRuntime", "init_ray",
    "make_placement", "plan_bundles", "policy_ranks", "required_cpus", "start_ray"
]
