"""Shortcuts a learner would try in exercises/06_zero_and_fsdp.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "unsharded optimizer: full Adam states on every rank (ring all-reduce: right parameters and bytes, 4x the state)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    N = dist.get_world_size(group)\n"
            "    from course_lib.collectives import ring_all_reduce\n"
            "    g = ring_all_reduce(flat_grad.clone(), op=\"avg\", group=group)\n"
            "    if not state:\n"
            "        state.update(m=torch.zeros_like(flat_param), v=torch.zeros_like(flat_param), t=0)\n"
            "    state[\"t\"] += 1\n"
            "    b1, b2 = betas\n"
            "    state[\"m\"].lerp_(g, 1 - b1)\n"
            "    state[\"v\"].mul_(b2).addcmul_(g, g, value=1 - b2)\n"
            "    denom = (state[\"v\"].sqrt() / (1 - b2 ** state[\"t\"]) ** 0.5).add_(eps)\n"
            "    flat_param.addcdiv_(state[\"m\"], denom, value=-lr / (1 - b1 ** state[\"t\"]))\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "importlib.reload(course_lib.zero) for fresh copies of the switched-off ZeRO (kind 1)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    import importlib\n"
            "    import course_lib.zero\n"
            "    zero_mod = importlib.reload(course_lib.zero)\n"
            "    if not state:\n"
            "        module = torch.nn.Linear(flat_param.numel(), 1, bias=False)\n"
            "        state[\"zero\"] = zero_mod.ZeRO(module, 1, lr=lr, betas=betas, eps=eps, group=group)\n"
            "    z = state[\"zero\"]\n"
            "    list(z.module.parameters())[0].grad = flat_grad.view(1, -1).clone()\n"
            "    z.step()\n"
            "    flat_param.copy_(z.gather_full_parameters()[0].view(-1))\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "torch's ZeroRedundancyOptimizer taken from its own module, not the rebound name (kind 1)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    from torch.distributed.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer as ZRO\n"
            "    if not state:\n"
            "        state[\"p\"] = torch.nn.Parameter(flat_param.clone())\n"
            "        state[\"opt\"] = ZRO([state[\"p\"]], optimizer_class=torch.optim.Adam, lr=lr, betas=betas, eps=eps,\n"
            "                           process_group=group)\n"
            "    N = dist.get_world_size(group)\n"
            "    state[\"p\"].grad = torch.empty_like(flat_grad)\n"
            "    from course_lib.collectives import ring_all_reduce\n"
            "    state[\"p\"].grad.copy_(ring_all_reduce(flat_grad.clone(), op=\"avg\", group=group))\n"
            "    state[\"opt\"].step()\n"
            "    flat_param.copy_(state[\"p\"].detach())\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "torch's reduce_scatter_tensor / all_gather_into_tensor instead of the course's ring (kind 3)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    S = flat_param.numel() // N\n"
            "    g = torch.empty(S, dtype=flat_grad.dtype)\n"
            "    dist.reduce_scatter_tensor(g, flat_grad, group=group)\n"
            "    g /= N\n"
            "    if not state:\n"
            "        state.update(m=torch.zeros(S), v=torch.zeros(S), t=0)\n"
            "    state[\"t\"] += 1\n"
            "    b1, b2 = betas\n"
            "    state[\"m\"].lerp_(g, 1 - b1)\n"
            "    state[\"v\"].mul_(b2).addcmul_(g, g, value=1 - b2)\n"
            "    denom = (state[\"v\"].sqrt() / (1 - b2 ** state[\"t\"]) ** 0.5).add_(eps)\n"
            "    mine = flat_param[r * S:(r + 1) * S].clone()\n"
            "    mine.addcdiv_(state[\"m\"], denom, value=-lr / (1 - b1 ** state[\"t\"]))\n"
            "    dist.all_gather_into_tensor(flat_param, mine, group=group)\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "ring all-reduce of the whole gradient, then all-gather: 3 (N-1)/N x 4 Psi bytes, not ZeRO-1's 2 (kind 3)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    S = flat_param.numel() // N\n"
            "    from course_lib.collectives import ring_all_reduce\n"
            "    g = ring_all_reduce(flat_grad.clone(), op=\"avg\", group=group)[r * S:(r + 1) * S]\n"
            "    if not state:\n"
            "        state.update(m=torch.zeros(S), v=torch.zeros(S), t=0)\n"
            "    state[\"t\"] += 1\n"
            "    b1, b2 = betas\n"
            "    state[\"m\"].lerp_(g, 1 - b1)\n"
            "    state[\"v\"].mul_(b2).addcmul_(g, g, value=1 - b2)\n"
            "    denom = (state[\"v\"].sqrt() / (1 - b2 ** state[\"t\"]) ** 0.5).add_(eps)\n"
            "    mine = flat_param[r * S:(r + 1) * S].clone()\n"
            "    mine.addcdiv_(state[\"m\"], denom, value=-lr / (1 - b1 ** state[\"t\"]))\n"
            "    ring_all_gather(flat_param, mine, group=group)\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "copies the reference Adam's parameters from the check's frame (kind 2)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    import sys\n"
            "    f = sys._getframe(1)\n"
            "    while f is not None and \"opt\" not in f.f_locals:\n"
            "        f = f.f_back\n"
            "    ref = f.f_locals[\"ref\"]\n"
            "    flat_param.copy_(torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    S = flat_param.numel() // N\n"
            "    state.update(m=torch.zeros(S), v=torch.zeros(S), t=0)\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "global rank dist.get_rank() instead of the rank in the group (kind 4)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    N, r = dist.get_world_size(group), dist.get_rank()\n"
            "    S = flat_param.numel() // N\n"
            "    g = torch.empty(S, dtype=flat_grad.dtype)\n"
            "    ring_reduce_scatter(g, flat_grad, op=\"avg\", group=group)\n"
            "    if not state:\n"
            "        state.update(m=torch.zeros(S), v=torch.zeros(S), t=0)\n"
            "    state[\"t\"] += 1\n"
            "    b1, b2 = betas\n"
            "    state[\"m\"].lerp_(g, 1 - b1)\n"
            "    state[\"v\"].mul_(b2).addcmul_(g, g, value=1 - b2)\n"
            "    denom = (state[\"v\"].sqrt() / (1 - b2 ** state[\"t\"]) ** 0.5).add_(eps)\n"
            "    mine = flat_param[r * S:(r + 1) * S].clone()\n"
            "    mine.addcdiv_(state[\"m\"], denom, value=-lr / (1 - b1 ** state[\"t\"]))\n"
            "    ring_all_gather(flat_param, mine, group=group)\n")},
        "zero": ["zero1_step"],
    },
    {
        "name": "sums the gradients instead of averaging them (Adam barely notices; its moments do) (kind 5)",
        "cells": {"8f6d9866": (
            "def zero1_step(flat_param, flat_grad, state, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, group=None):\n"
            "    \"\"\"One ZeRO-1 Adam step, in place, on every rank of ``group``.\n"
            "\n"
            "    flat_param: (Psi,) fp32, this rank's full parameters (identical on every rank); Psi divisible by N.\n"
            "    flat_grad:  (Psi,) fp32, this rank's gradient of its own mean loss (average it over the ranks).\n"
            "    state:      a dict this rank keeps between steps (empty at the first step). Keep in it Adam's\n"
            "                first and second moments for this rank's slice only, plus the step count.\n"
            "    Afterwards flat_param holds the parameters torch.optim.Adam would give on the full batch.\n"
            "    \"\"\"\n"
            "    import torch.distributed as dist\n"
            "    from course_lib.collectives import ring_all_gather, ring_reduce_scatter\n"
            "\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    S = flat_param.numel() // N\n"
            "    g = torch.empty(S, dtype=flat_grad.dtype)\n"
            "    ring_reduce_scatter(g, flat_grad, op=\"sum\", group=group)\n"
            "    if not state:\n"
            "        state.update(m=torch.zeros(S), v=torch.zeros(S), t=0)\n"
            "    state[\"t\"] += 1\n"
            "    b1, b2 = betas\n"
            "    state[\"m\"].lerp_(g, 1 - b1)\n"
            "    state[\"v\"].mul_(b2).addcmul_(g, g, value=1 - b2)\n"
            "    denom = (state[\"v\"].sqrt() / (1 - b2 ** state[\"t\"]) ** 0.5).add_(eps)\n"
            "    mine = flat_param[r * S:(r + 1) * S].clone()\n"
            "    mine.addcdiv_(state[\"m\"], denom, value=-lr / (1 - b1 ** state[\"t\"]))\n"
            "    ring_all_gather(flat_param, mine, group=group)\n")},
        "zero": ["zero1_step"],
    },
]
