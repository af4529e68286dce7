"""The batch's room: a step's batch between the two processes, in one array form from the orchestrator's records
to the learner's tensors. The orchestrator prepares it (prepare), the learner reads its rank's rows (format) and
turns them into tensors (agentloop.train.trainer.collate).

Map, in the order a step's data passes:
    episodes     usable records -> the episodes that enter the loss, the batch's numbers (prepare_episodes)
    advantages   the estimator registry (grpo, rloo, reinforce_pp) and compute_advantages
    packing      mini-batches, rows (shared prompts), every rank's micro-batches: episode indices (plan_ranks)
    prepare      records -> TrainBatch, for the learner's BatchLayout (prepare_batch)
    format       BatchLayout, TrainBatch and its safetensors file; RankBatch, one rank's share read from it

numpy only, no torch: the orchestrator prepares the batch without importing it.

Add an advantage estimator: write `fn(rewards, groups, lengths, cfg) -> ndarray[B]` (numpy arrays in),
decorate it with `@register_estimator("name")` (agentloop.train.batch.advantages), and set
`algo.estimator=name`.
"""
