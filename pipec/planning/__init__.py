"""The plan pass's parts, one concept per module; ``pipec.planner.plan`` is the entry point.

| module | owns |
|---|---|
| ``values.py`` | the request and the results (``PlanRequest``, ``Plan``, ``StagePlan`` …) |
| ``costs.py`` | ``Layout``, ``Point`` and the cost arrays every point shares (``Costs``) |
| ``sharding.py`` | sharded data parallelism (FSDP): what a sharded stage holds, its collectives |
| ``balance.py`` | the strategies and the boundary rule each one balances with |
| ``layouts.py`` | the search space: pp × dp layouts, micro-batch sizes, schedules, points |
| ``evaluate.py`` | one point: its boundaries and memory, then its simulated iteration |
| ``search.py`` | branch and bound over the points |
| ``baselines.py`` | the baselines' plans, and adopting one |
| ``maxbatch.py`` | the largest global batch each strategy trains |

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
