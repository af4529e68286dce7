"""The trainer's room: the learner's process (one per rank), which trains the batches the learner handle hands it
and publishes the weights. Nothing here imports the orchestrator.

Map:
    main            the command line, `python -m agentloop.train.trainer` (what learner_command builds)
    serve           the learner loop: rank 0 polls the inbox and broadcasts; every rank trains, checkpoints,
                    publishes the weights (agentloop.train.weights); the final save
    learner         Learner: model + optimizer (+ reference), train_batch, compute_logprobs, save_hf, checkpoints;
                    usable in-process
    distributed     the process group: device, torchrun's group or a one-rank one, rank 0's broadcast
    collate         a rank's planned micro-batches -> tensors (packed or padded rows, shared prompts)
    attention       packed rows' masks: FlexAttention block masks (CUDA), FlashAttention varlen, dense SDPA
                    masks; the check that a model honours the mask
    logprobs        logprobs / entropy from the final hidden states in chunks (no [tokens x vocab] tensor), as a
                    patch of the model's LM head
    losses          PPO clipped loss (decoupled: behaviour / proximal / current), aggregation weights, KL terms,
                    entropy, TIS and ratio masking, device-side Stats
    rollout_correction  verl's rollout correction: sequence-level importance weights, rejection sampling
    verl_order      verl's order of a step (KL in the reward, rejection) between the no-grad passes and the update
    checkpoint      resumable sharded checkpoints (atomic: temp dir + rename), synchronous or in the background
    zygote          a fork server for one-rank learners: torch, transformers and the learner imported once

Who calls whom: main -> serve -> Learner -> collate / attention / logprobs / losses / verl_order / checkpoint;
serve -> the inbox (agentloop.train.handle) and the learner half of the weight transport.
"""
