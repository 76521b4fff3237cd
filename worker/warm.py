"""The fork server's preload: importing this module does torch's lazy imports up front, and makes
the fork server the keeper of its jobs' orphans (worker/reaper.py).

The fork server preloads it so that every job process, forked from there, starts with them done
(the first optimizer pulls in torch._dynamo: ~1.5 s). It only imports: running a tensor op here
would start OpenMP's thread pool, and a process forked after that can hang on its first parallel
op. Nor may it touch CUDA: each job would inherit a broken context. Nothing but the fork server
imports this module.
"""
import torch._dynamo
import torch.optim  # noqa: F401
import torchvision  # noqa: F401

from trainyard.worker import reaper

reaper.set_up_fork_server()
