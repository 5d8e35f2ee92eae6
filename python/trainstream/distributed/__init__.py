"""Data-parallel and multi-node jobs: which job this process is a rank of, and where the other nodes'
daemons are.

group.py  wrap's `distributed`: this process's rank among the node's ranks, from torch.distributed or
          the environment
peers.py  the peer-plane addresses of a multi-node job's daemons, in node order
"""
