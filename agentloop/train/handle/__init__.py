"""The learner handle's room: how the orchestrator and the learner talk, whatever carries it.

Map:
    protocol   LearnerHandle (the orchestrator's side), LearnerInbox (learner rank 0's side) and the facts that
               cross between them (LearnerInfo, UpdateResult, SyncRequest, PushOrder, WeightsOnDisk, errors)
    mailbox    the file carrier: MailboxClient (orchestrator side), LearnerMailbox (the learner's inbox); the
               orchestrator's FileLearner wraps it (agentloop.train.orchestrator.learner_process)
    launch     the file carrier's learner process: its environment, and the zygote variable that may fork it
The other carrier is Ray's (agentloop.cluster.ray_learner); the same tests run against both.
"""
