"""One data-parallel rank for the multi-rank tests: trains its shard of each batch through a shared
trainstreamd job and saves its final parameters."""

import argparse
import os

import torch

import trainstream


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def batch(step: int, rows: int = 48):  # divisible by every shard count the tests use
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--peers", default="", help="comma-separated peer addresses of the job's daemons")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--from-env", action="store_true",
                        help="ranks and nodes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), peers "
                             "from the torch.distributed store; --world-size, --peers and --node-rank are ignored")
    parser.add_argument("--dist-init", default=None, help="init_method of a gloo process group over all ranks")
    parser.add_argument("--param-offload", action="store_true", help="page both Linear layers' weights (CPU)")
    args = parser.parse_args()

    if args.dist_init:
        torch.distributed.init_process_group("gloo", init_method=args.dist_init, rank=int(os.environ["RANK"]),
                                             world_size=int(os.environ["WORLD_SIZE"]))
    model = make_model(seed=100 + args.rank)  # every rank starts elsewhere: rank 0's weights must win
    print("attaching", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    common = dict(client=trainstream.connect(args.socket), job=args.job, accumulation_steps=args.accumulation_steps,
                  max_grad_norm=args.max_grad_norm)
    if args.param_offload:
        common.update(device="cpu", param_offload=True, blocks=[model[0], model[2]])
    if args.from_env:
        model, opt = trainstream.wrap(model, opt, **common)
        # this rank's place among every rank of every node
        shards, shard_index = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    else:
        peers = [p for p in args.peers.split(",") if p]
        model, opt = trainstream.wrap(model, opt, rank=args.rank, world_size=args.world_size, peers=peers,
                                      node_rank=args.node_rank, **common)
        shards = args.world_size * max(1, len(peers))
        shard_index = args.node_rank * args.world_size + args.rank
    k = args.accumulation_steps
    for step in range(args.steps):
        for micro in range(k):
            x, y = batch(step * k + micro)
            shard = slice(shard_index * len(x) // shards, (shard_index + 1) * len(x) // shards)
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
        print(f"step {step}", flush=True)
    trainstream.synchronize()
    weights = model.state_dict()  # paged weights are not all in GPU slots: the state dict has them all
    torch.save([weights[name].clone() for name, _ in model.named_parameters()], args.out)


if __name__ == "__main__":
    main()
