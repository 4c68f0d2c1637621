"""The plan pass: search pp × dp, micro-batch size and schedule; partition stages with the
exact DP. ``plan(graph, request)`` is the entry point.

| module | owns |
|---|---|
| ``planner.py`` | the pass: check the request, search, adopt a baseline, report (``plan``) |
| ``values.py`` | the request and the results (``PlanRequest``, ``Plan``, ``StagePlan`` …) |
| ``points.py`` | ``Layout``, ``Point`` and the cost arrays every point shares (``Costs``) |
| ``schedules.py`` | each device's order of actions under a schedule (GPipe, 1F1B, …) |
| ``zero_bubble.py`` | the zero-bubble schedules' orders (ZB-H1, ZB-V) |
| ``simulate.py`` | a schedule's iteration time, bubble and in-flight micro-batches |
| ``spans.py`` | what a stage costs over one span of nodes |
| ``partition.py`` | exact DP over contiguous stages under memory |
| ``device_peak.py`` | the peak of a device that holds several stages |
| ``sharding.py`` | sharded data parallelism (FSDP): what a sharded stage holds, its collectives |
| ``balance.py`` | the strategies and the boundary rule each one balances with |
| ``layouts.py`` | the search space: pp × dp layouts, micro-batch sizes, schedules, points |
| ``evaluate.py`` | one point: its boundaries and memory, then its simulated iteration |
| ``choice.py`` | the choice under the time model's error (the decision margin) |
| ``search.py`` | branch and bound over the points |
| ``baselines.py`` | the baselines' plans, and adopting one |
| ``maxbatch.py`` | the largest global batch each strategy trains |
| ``tp_search.py`` | pp × dp plans of one tensor-parallel rank, for each tp degree |

Glossary (besides docs/architecture.md's):

- *strategy*: how a whole plan is made: ``"pipec"`` (the search) or a baseline (``"uniform"``,
  ``"parameters"``, ``"torchgpipe"``, ``"conventional"``). ``--strategy``, plan.json's
  ``strategy``, ``baselines[].name`` and the keys of ``max_batch.baselines`` name one.
- *balance*: the rule that places a strategy's stage boundaries, what its partition balances:
  ``"time_within_memory"`` (pipec), ``"time"``, ``"parameters"`` or ``"uniform"``; or
  ``"pinned"``, the boundaries --boundaries gives (pipec's search, the largest-batch table
  aside, which reports what pipec's own balance trains). Two
  strategies may share one (torchgpipe and conventional balance time; they differ in
  micro-batch, schedule and layout).
- *layout*: pp pipeline devices × dp replicas, v stages per device (interleaved), the rank
  order, and whether the replicas shard each stage (FSDP) or replicate it (DDP).
- *point*: a layout with a micro-batch size and a schedule: what the search evaluates.
"""

from pipec.planning.planner import check, check_request, plan
from pipec.planning.tp_search import TpPlan, plan_with_tp, tp_degrees
from pipec.planning.values import Plan, PlanRequest, StagePlan

__all__ = ["Plan", "PlanRequest", "StagePlan", "TpPlan", "check", "check_request", "plan",
           "plan_with_tp", "tp_degrees"]
