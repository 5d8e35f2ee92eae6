"""Which data-parallel job this process is a rank of (wrap's `distributed`): its rank among this node's
ranks, how many there are, this node's index and the node count, the job's name and the daemon.

The first source that applies:
  1. explicit `rank=` / `world_size=` (and `job=`);
  2. `distributed=False`: a job of its own;
  3. torchrun's environment: LOCAL_RANK / LOCAL_WORLD_SIZE, the job named after TORCHELASTIC_RUN_ID;
  4. an initialized torch.distributed process group of more than one rank (with or without torchrun's
     variables): the ranks agree over a gloo group (the default group when its backend has gloo, else a
     new one). All-gathered host names give the nodes (numbered by their first global rank) and the
     node-local ranks (in global rank order); local rank 0 of each node connects first, starting a
     private daemon when none is found, and the node's other ranks connect to the daemon it uses; the
     job is the name every rank passed, else one made by rank 0.
`distributed=True` requires 3 or 4. Every rank reaches the same verdict (errors included), so none is
left waiting in a collective for another that gave up. A job spanning nodes of one process group starts
from global rank 0's weights on every node (share_first_ranks_weights).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from trainstream._C import TrainstreamError
from trainstream._connect import Client, connect

CHOICES = ("auto", True, False)


@dataclass
class Placement:
    rank: int = 0                 # among this node's ranks
    world_size: int = 1           # this node's ranks
    job: str | None = None
    node_rank: int | None = None  # None: from the environment (peers.env_node_rank)
    nodes: int | None = None      # None: from the environment (peers.env_node_count)
    client: Client | None = None
    agreed_name: bool = False     # the job's name was made up here: nobody can resume it


def place(distributed, rank: int | None, world_size: int | None, job: str | None,
          client: Client | None) -> Placement:
    if not any(distributed is c for c in CHOICES):
        raise TrainstreamError(f"distributed={distributed!r}: use 'auto' (data parallel when an initialized "
                               "torch.distributed group has more than one rank), True (require one) or False")
    if rank is not None or world_size is not None:
        return Placement(0 if rank is None else rank, 1 if world_size is None else world_size, job, client=client)
    if distributed is False:
        return Placement(job=job, client=client)
    env = os.environ
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return _from_torchrun(env, job, client)
    if not _group_size() > 1:
        if distributed is True:
            raise TrainstreamError("distributed=True, but there is no initialized torch.distributed process group "
                                   "with more than one rank (call torch.distributed.init_process_group first) and "
                                   "no torchrun environment (LOCAL_RANK, LOCAL_WORLD_SIZE)")
        return Placement(job=job, client=client)
    return _from_group(job, client)


def _group_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _from_torchrun(env, job: str | None, client: Client | None) -> Placement:
    local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    spans_nodes = int(env.get("WORLD_SIZE", local_world)) > local_world
    if job is None and (local_world > 1 or spans_nodes) and "TORCHELASTIC_RUN_ID" in env:
        if env["TORCHELASTIC_RUN_ID"] == "none":  # torchrun's default without --rdzv-id or --standalone
            raise TrainstreamError("torchrun's run id is 'none' (no --rdzv-id): every such run would be the job "
                                   "'torchrun-none' and resume the last one's state; pass job= to trainstream.wrap, "
                                   "or start torchrun with --rdzv-id=<unique id> or --standalone")
        job = f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    return Placement(local_rank, local_world, job, client=client)


_gloo_groups: dict[int, object] = {}  # id(default group) -> the gloo group trainstream agrees over


def _gloo_group():
    """The group the ranks agree over: the default one when it has gloo, else a gloo group of the same
    ranks (made once per default group; every rank makes it in its first wrap)."""
    dist = torch.distributed
    if "gloo" in str(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _gloo_groups:
        _gloo_groups[key] = dist.new_group(backend="gloo")
    return _gloo_groups[key]


def _from_group(job: str | None, client: Client | None) -> Placement:
    dist = torch.distributed
    group = _gloo_group()
    world, me = dist.get_world_size(), dist.get_rank()
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    nodes = list(dict.fromkeys(hosts))  # in the order of their first global rank
    local = [r for r in range(world) if hosts[r] == hosts[me]]
    local_rank = local.index(me)
    failure = None
    if client is None and local_rank == 0:
        try:
            client = connect()
        except TrainstreamError as e:  # told to every rank below, so that none waits for this one
            failure = str(e)
    proposal = f"dist-{hosts[0]}-{os.getpid()}-{_next_name()}" if me == 0 else None
    mine = (client.socket_path if client is not None else None, job, proposal, failure)
    told = [None] * world
    dist.all_gather_object(told, mine, group=group)
    _check_agreement(told, local, hosts[me])
    leader_socket = told[local[0]][0]
    if client is None:
        client = connect(leader_socket)
    agreed = job is None
    return Placement(local_rank, len(local), told[0][2] if agreed else job, node_rank=nodes.index(hosts[me]),
                     nodes=len(nodes), client=client, agreed_name=agreed)


def _check_agreement(told: list[tuple], local: list[int], host: str) -> None:
    """Raises on every rank alike when a rank could not connect, the ranks of a node would use different
    daemons, or the ranks passed different job names."""
    failed = [(r, t[3]) for r, t in enumerate(told) if t[3]]
    if failed:
        r, message = failed[0]
        raise TrainstreamError(f"rank {r} (local rank 0 of its node) could not reach a trainstreamd: {message}")
    sockets = {told[r][0] for r in local if told[r][0] is not None}
    if len(sockets) > 1:
        raise TrainstreamError(f"the ranks on {host} use different trainstreamd sockets {sorted(sockets)}: the ranks "
                               "of a node share one daemon (pass the same client, or none)")
    names = {t[1] for t in told}
    if len(names) > 1:
        raise TrainstreamError(f"the ranks passed different job names {sorted(map(repr, names))}: pass the same job= "
                               "on every rank, or none")


def share_first_ranks_weights(params: list[torch.Tensor]) -> None:
    """Every rank takes global rank 0's parameter values, over the gloo group: a job spanning nodes has a
    daemon per node, each seeding its job from its node's first rank (the daemons' all-reduce keeps
    them equal from then on). Call on every rank, before attaching."""
    dist = torch.distributed
    group = _gloo_group()
    with torch.no_grad():
        for p in params:
            host = p.detach().to("cpu", copy=True).contiguous()
            dist.broadcast(host, src=0, group=group)
            p.copy_(host)


def spans_group(nodes: int) -> bool:
    """Whether the job spans nodes whose ranks share an initialized process group."""
    return nodes > 1 and _group_size() > 1


_counter = 0


def _next_name() -> int:
    global _counter
    _counter += 1
    return _counter
