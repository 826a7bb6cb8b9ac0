"""The simulated RL post-training pipeline: rollout on modelled engines, training, weight sync.

`pipeline` carries out each system's decisions step by step; `driver` routes turns to engines;
`systems` and `planned` are the systems compared (their layouts come from the scenario or from
the planner's controller); `elastic_pool` moves hybrid replicas; `config` is the typed scenario;
`report` writes the plots.
"""
