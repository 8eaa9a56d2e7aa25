"""Shortcuts a learner would try in exercises/03_collectives.ipynb; each must score zero where listed."""
HEAD = ("def ring_all_reduce(tensor, group=None):\n    import torch\n    import torch.distributed as dist\n")
CASES = [
    {
        "name": "calls dist.all_reduce instead of the ring",
        "cells": {"ex1-code": HEAD + "    dist.all_reduce(tensor, group=group)\n    return tensor"},
        "zero": ["ring_all_reduce"],
    },
    {
        "name": "calls the built-in all-reduce by another name",
        "cells": {"ex1-code": HEAD + "    from torch.distributed import distributed_c10d as c\n"
                                     "    c.all_reduce(tensor, group=group)\n    return tensor"},
        "zero": ["ring_all_reduce"],
    },
    {
        "name": "ring_all_reduce of a second copy of course_lib/collectives.py (kind 1)",
        "cells": {"ex1-code": HEAD + (
            "    import importlib.util\n    import course_lib.collectives\n"
            "    spec = importlib.util.spec_from_file_location('my_collectives', course_lib.collectives.__file__)\n"
            "    mine = importlib.util.module_from_spec(spec)\n    spec.loader.exec_module(mine)\n"
            "    mine.ring_all_reduce(tensor, group=group)\n    return tensor")},
        "zero": ["ring_all_reduce"],
    },
    {
        "name": "reduce_scatter_tensor + all_gather_into_tensor",
        "cells": {"ex1-code": HEAD + (
            "    N = dist.get_world_size(group)\n    n = tensor.numel()\n    m = -(-n // N) * N\n"
            "    padded = torch.zeros(m, dtype=tensor.dtype)\n    padded[:n] = tensor\n"
            "    part = torch.empty(m // N, dtype=tensor.dtype)\n"
            "    dist.reduce_scatter_tensor(part, padded, group=group)\n"
            "    dist.all_gather_into_tensor(padded, part, group=group)\n"
            "    tensor.copy_(padded[:n])\n    return tensor")},
        "zero": ["ring_all_reduce"],
    },
    {
        "name": "sends the whole tensor to every other rank (right sum, not a ring)",
        "cells": {"ex1-code": HEAD + (
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    rank_of = lambda g: g if group is None else dist.get_global_rank(group, g)\n"
            "    if tensor.numel() == 0 or N == 1:\n        return tensor\n"
            "    bufs = {p: torch.empty_like(tensor) for p in range(N) if p != r}\n"
            "    works = [dist.irecv(b, rank_of(p), group=group) for p, b in bufs.items()]\n"
            "    works += [dist.isend(tensor, rank_of(p), group=group) for p in bufs]\n"
            "    for w in works:\n        w.wait()\n"
            "    for b in bufs.values():\n        tensor.add_(b)\n    return tensor")},
        "zero": ["ring_all_reduce"],
    },
    {
        "name": "copies dist.all_reduce's result from the checking function's frame, with a ring's worth of dummy traffic",
        "cells": {"ex1-code": HEAD + (
            "    import sys\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    rank_of = lambda g: g if group is None else dist.get_global_rank(group, g)\n"
            "    n = 2 * (tensor.numel() - tensor.numel() // N)   # what a ring sends: 2 (N - 1) chunks\n"
            "    if n and N > 1:\n"
            "        out, buf = torch.zeros(n, dtype=tensor.dtype), torch.empty(n, dtype=tensor.dtype)\n"
            "        works = [dist.irecv(buf, rank_of((r - 1) % N), group=group), dist.isend(out, rank_of((r + 1) % N), group=group)]\n"
            "        for w in works:\n            w.wait()\n"
            "    return tensor.copy_(sys._getframe(1).f_locals['expected'])")},
        "zero": ["ring_all_reduce"],
    },
]
