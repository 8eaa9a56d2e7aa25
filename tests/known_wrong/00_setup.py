"""Shortcuts a learner would try in exercises/00_setup.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "hard-codes the four-rank answer",
        "cells": {"ex1-code": "def rank_squared(rank, world_size):\n    return [0, 1, 4, 9][rank]"},
        "zero": ["rank_squared"],
    },
    {
        "name": "gathers every pid with all_gather_object instead of passing the token",
        "cells": {"ex2-code": (
            "def pass_token(rank, world_size):\n    import os\n    import torch.distributed as dist\n"
            "    if world_size == 1:\n        return [os.getpid()]\n    pids = [None] * world_size\n"
            "    dist.all_gather_object(pids, os.getpid())\n"
            "    return pids if rank == 0 else pids[:rank + 1] + [0] * (world_size - rank - 1)")},
        "zero": ["ring_token"],
    },
    {
        "name": "sums the local data without any communication",
        "cells": {"ex3-code": (
            "def distributed_sum(rank, world_size, shard):\n"
            "    return shard.sum().item(), shard.sum().item()")},
        "zero": ["allreduce_sum"],
    },
    {
        "name": "all-gathers the partial sums instead of one all_reduce",
        "cells": {"ex3-code": (
            "def distributed_sum(rank, world_size, shard):\n    import torch, torch.distributed as dist\n"
            "    parts = [torch.zeros(1, dtype=shard.dtype) for _ in range(world_size)]\n"
            "    dist.all_gather(parts, shard.sum().reshape(1))\n"
            "    return shard.sum().item(), torch.cat(parts).sum().item()")},
        "zero": ["allreduce_sum"],
    },
]
