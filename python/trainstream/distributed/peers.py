"""The peer-plane addresses of a multi-node job's daemons, in node order, and this node's index.

Explicit (wrap(peers=, node_rank=)), else $TRAINSTREAM_PEERS / $TRAINSTREAM_NODE_RANK. Otherwise, when
torchrun's environment says the job spans several nodes (WORLD_SIZE > LOCAL_WORLD_SIZE), or the ranks of
an initialized process group found several hosts (distributed/group.py), they are exchanged through the job's
torch.distributed store: local rank 0 of every node sets
"trainstream/<job>/peer/<node>" to its daemon's advertised address (Client.peer_address, "" when the
daemon has no peer plane), and every rank reads the keys of all nodes.
"""

from __future__ import annotations

import os

import torch

from trainstream._C import TrainstreamError
from trainstream._connect import Client


def env_peers() -> list[str]:
    return [p for p in os.environ.get("TRAINSTREAM_PEERS", "").split(",") if p]


def env_node_rank() -> int:
    """$TRAINSTREAM_NODE_RANK, else torchrun's GROUP_RANK, else RANK // LOCAL_WORLD_SIZE, else 0."""
    env = os.environ
    for name in ("TRAINSTREAM_NODE_RANK", "GROUP_RANK"):
        if name in env:
            return int(env[name])
    if "RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["RANK"]) // int(env["LOCAL_WORLD_SIZE"])
    return 0


def env_node_count() -> int:
    """How many nodes torchrun's environment spans: GROUP_WORLD_SIZE, else WORLD_SIZE // LOCAL_WORLD_SIZE
    (1 outside torchrun)."""
    env = os.environ
    if "WORLD_SIZE" not in env or "LOCAL_WORLD_SIZE" not in env:
        return 1
    world, local_world = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    if "GROUP_WORLD_SIZE" in env:
        return int(env["GROUP_WORLD_SIZE"])
    if world % local_world != 0:
        raise TrainstreamError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: every "
                               "node must run the same number of ranks")
    return world // local_world


def job_store() -> torch.distributed.Store:
    """The default store of the initialized process group, else torchrun's agent store."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    env = os.environ
    if dist.is_available() and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:
            return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                 timeout=dist.distributed_c10d.default_pg_timeout)
        except (KeyError, ValueError, RuntimeError) as e:
            raise TrainstreamError(f"cannot reach torchrun's agent store at MASTER_ADDR:MASTER_PORT "
                                   f"({env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}): {e}") from e
    raise TrainstreamError(f"WORLD_SIZE={env.get('WORLD_SIZE')} spans several nodes, but there is no "
                           "torch.distributed store to exchange the daemons' peer addresses through (initialize a "
                           "process group first, or run under torchrun): pass peers= (the nodes' trainstreamd peer "
                           "addresses, or set TRAINSTREAM_PEERS)")


def _key(job: str, node: int) -> str:
    return f"trainstream/{job}/peer/{node}"


def _read(store: torch.distributed.Store, job: str, node: int) -> str:
    try:
        return store.get(_key(job, node)).decode()
    except RuntimeError as e:  # the store's timeout (DistStoreError) or a lost store
        raise TrainstreamError(f"node {node} did not publish its trainstreamd peer address ('{_key(job, node)}' in "
                               f"the torch.distributed store) within the store's timeout of {store.timeout}: does "
                               f"local rank 0 of node {node} call trainstream.wrap with job={job!r}? ({e})") from e


def _no_peer_plane(which: str, job: str, nodes: int) -> TrainstreamError:
    return TrainstreamError(f"{which} has no peer plane (started without --peer-listen), so job {job!r} cannot "
                            f"span {nodes} nodes: start trainstreamd with --peer-listen and --peer-secret-file on "
                            "every node (docs/multi-node.md)")


def exchange(store: torch.distributed.Store, client: Client, job: str, node_rank: int, nodes: int,
             local_rank: int) -> list[str]:
    """Local rank 0 publishes this node's daemon address; every rank returns all nodes' addresses."""
    if not 0 <= node_rank < nodes:
        raise TrainstreamError(f"node rank {node_rank} out of range for {nodes} nodes")
    own = client.peer_address
    if local_rank == 0:
        store.set(_key(job, node_rank), own)  # "" tells the other nodes why this one cannot take part
    if not own:
        raise _no_peer_plane(f"this node's trainstreamd ({client.socket_path})", job, nodes)
    peers = []
    for node in range(nodes):
        address = _read(store, job, node)
        if not address:
            raise _no_peer_plane(f"node {node}'s trainstreamd", job, nodes)
        peers.append(address)
    if own != peers[node_rank]:
        raise TrainstreamError(f"this rank's trainstreamd ({client.socket_path}) advertises '{own}' but local rank 0 "
                               f"of node {node_rank} published '{peers[node_rank]}': the ranks of a node must share "
                               "one daemon")
    return peers


def resolve(peers: list[str] | None, node_rank: int | None) -> tuple[list[str], int]:
    """Explicit or environment peers and node rank; [] when they must come from the store (or one node)."""
    peers = env_peers() if peers is None else list(peers)
    node_rank = env_node_rank() if node_rank is None else node_rank
    if peers and not 0 <= node_rank < len(peers):
        raise TrainstreamError(f"node_rank {node_rank} out of range for {len(peers)} peers")
    return peers, node_rank
