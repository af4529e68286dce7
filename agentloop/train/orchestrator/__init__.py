"""The orchestrator's room: the process of `agentloop train` that owns the servers, the rollouts and the step
loop, and talks to the learner only through a learner handle (agentloop.train.handle) and to the servers through
a server pool and the ServerManager's methods. Nothing here imports the trainer (FSDP, the model).

Map, in the order a run meets them:
    resume           the config of a resumed run: its saved config + the values given now, pinned keys refused
    backend          Backend (where servers and learner run) and LocalBackend, this host
    learner_process  LearnerProcess + learner_command: the learner as a child process group; FileLearner, the
                     learner handle over it and the file mailbox
    served_model     what the servers serve against model.path, before step 1
    cursor           DataCursor: resumable, epoch-shuffled prompt order, the rows' fingerprint
    schedule         the async schedule's rules and AsyncSchedule, the pure object the step loop drives
    loop             the step loop: rollouts -> batch (agentloop.train.batch.prepare) -> learner -> weights into
                     the servers (agentloop.train.weights.servers), and `run_train`, the whole run

Who calls whom: loop -> schedule, cursor, served_model, backend -> learner_process; loop -> the planning room
(preflight), the batch room (prepare_batch), the weights room (the server halves), the handle room (the protocol).
"""
