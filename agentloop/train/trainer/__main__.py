"""`python -m agentloop.train.trainer`: the learner process (agentloop.train.trainer.main)."""

import sys

from agentloop.train.trainer.main import main

sys.exit(main())
