"""A tiny job: every worker push_pulls its rank + 1 and checks the sum.

    bpsctl up --hosts examples/hosts.yaml
    bpsctl run -- python examples/push_pull.py
"""
import os
import sys

import numpy as np

import bpsctl.engine as bps

bps.init()
size = bps.size()
total = bps.push_pull(np.full(1024, bps.rank() + 1.0, dtype=np.float32), name="x", average=False)
expected = size * (size + 1) / 2
print(f"rank {bps.rank()} of {size} (local {os.environ.get('LOCAL_RANK')} of "
      f"{os.environ.get('LOCAL_WORLD_SIZE')}): sum {total[0]:g}, expected {expected:g}", flush=True)
bps.shutdown()
sys.exit(0 if np.all(total == expected) else 1)
