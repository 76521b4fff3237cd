"""The fork server's preload: importing this module does torch's lazy imports up front, and makes
the fork server the keeper of its jobs' orphans (worker/supervisor/reaper.py).

The fork server preloads it so that every job process, forked from there, starts with them done
(the first optimizer pulls in torch._dynamo: ~1.5 s). It only imports: running a tensor op here
would start OpenMP's thread pool, and a process forked after that can hang on its first parallel
op. Nor may it touch CUDA: each job would inherit a broken context. Nothing but the fork server
imports this module.
"""
import gc

import torch._dynamo
import torch.optim  # noqa: F401
import torchvision  # noqa: F401

from trainyard.worker.supervisor import reaper

reaper.set_up_fork_server()
# What is preloaded lives as long as the fork server and every job forked from it: out of the cycle
# collector's sight, a job process's full collection scans its own objects, not the ~360,000 of torch
# and ours (150 ms on the development machine), and no longer writes to the pages it shares with the
# server for it (reference counts still do).
gc.freeze()
