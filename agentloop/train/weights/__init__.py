"""The weight transport's room: how a learner step's weights reach the servers, one path per
`learner.weight_sync`, each with a learner half (in the learner) and a server half (in the orchestrator) that
agree on the interrupt mode.

Map:
    sync      the learner half's base: WeightSync (publish: save or push), the registry of paths by name, buckets,
              the HTTP calls of a push; DiskSync, the disk path (save weights/step-N)
    tensor    TensorSync: CUDA IPC handles to /update_weights_from_tensor (servers on the learner's host)
    nccl      NcclSync: a NCCL group with every server rank, one broadcast per bucket
    servers   the server halves: DiskHalf (load the saved directory), PushHalf (pause, let the learner push,
              resume), by path name (server_half)

Importing the package registers every path (its modules register themselves by name).
"""

from agentloop.train.weights import nccl, tensor  # noqa: F401 - registers the tensor and nccl paths
