"""Shortcuts a learner would try in exercises/15_long_context.ipynb; each must score zero where listed."""

_RING_HEAD = (
    "def zigzag_positions(s, N, rank):\n"
    "    c = s // (2 * N)\n"
    "    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * N - 1 - rank) * c, (2 * N - rank) * c)])\n"
    "\n"
    "\n"
)

CASES = [
    {
        "name": "merge from the library (course_lib.context_parallel.merge)",
        "cells": {"ex1-code": (
            "def merge(out_a, lse_a, out_b, lse_b):\n"
            "    from course_lib import context_parallel as C\n"
            "    return C.merge(out_a, lse_a, out_b, lse_b)\n")},
        "zero": ["merge"],
    },
    {
        "name": "merge with exp(lse) as written (right on small scores, overflows float32 on large ones)",
        "cells": {"ex1-code": (
            "def merge(out_a, lse_a, out_b, lse_b):\n"
            "    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)\n"
            "    return (w_a[..., None] * out_a + w_b[..., None] * out_b) / (w_a + w_b)[..., None], torch.log(w_a + w_b)\n")},
        "zero": ["merge"],
    },
    {
        "name": "the mean of the two partial outputs (ignores each block's share of the softmax)",
        "cells": {"ex1-code": (
            "def merge(out_a, lse_a, out_b, lse_b):\n"
            "    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)\n")},
        "zero": ["merge"],
    },
    {
        # only the hidden check (-inf on both sides) tells: every visible case passes
        "name": "max-shifted merge that gives NaN for a row with no visible key on either side",
        "cells": {"ex1-code": (
            "def merge(out_a, lse_a, out_b, lse_b):\n"
            "    m = torch.maximum(lse_a, lse_b)\n"
            "    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)\n"
            "    out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / (w_a + w_b)[..., None]\n"
            "    return out, m + torch.log(w_a + w_b)\n")},
        "zero": ["merge"],
    },
    {
        "name": "online_attention from the library's attend_block, block by block",
        "cells": {"ex2-code": (
            "def online_attention(q, k, v, block_size, q_pos=None, k_pos=None):\n"
            "    from course_lib import context_parallel as C\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    for lo in range(0, k.shape[-2], block_size):\n"
            "        o, l = C.attend_block(q, k[..., lo:lo + block_size, :], v[..., lo:lo + block_size, :])\n"
            "        out, lse = merge(out, lse, o, l)\n"
            "    return out, lse\n")},
        "zero": ["online_attention"],
    },
    {
        "name": "F.scaled_dot_product_attention with a mask, its log-sum-exp from the full scores",
        "cells": {"ex2-code": (
            "def online_attention(q, k, v, block_size, q_pos=None, k_pos=None):\n"
            "    mask = None if q_pos is None else k_pos[None, :] <= q_pos[:, None]\n"
            "    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num(0.0)\n"
            "    x = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
            "    if mask is not None:\n"
            "        x = x.masked_fill(~mask, float('-inf'))\n"
            "    return out, torch.logsumexp(x, -1)\n")},
        "zero": ["online_attention"],
    },
    {
        # right values: only the size of the largest tensor tells
        "name": "the whole score matrix at once (right values, an s_q x s_k tensor)",
        "cells": {"ex2-code": (
            "def online_attention(q, k, v, block_size, q_pos=None, k_pos=None):\n"
            "    x = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
            "    if q_pos is not None:\n"
            "        x = x.masked_fill(k_pos[None, :] > q_pos[:, None], float('-inf'))\n"
            "    lse = torch.logsumexp(x, -1)\n"
            "    p = torch.exp(x - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])\n"
            "    return p @ v, lse\n")},
        "zero": ["online_attention"],
    },
    {
        "name": "blocks without the row maximum: exp(scores) overflows on large scores",
        "cells": {"ex2-code": (
            "def online_attention(q, k, v, block_size, q_pos=None, k_pos=None):\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    for lo in range(0, k.shape[-2], block_size):\n"
            "        x = q @ k[..., lo:lo + block_size, :].transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
            "        if q_pos is not None:\n"
            "            x = x.masked_fill(k_pos[lo:lo + block_size][None, :] > q_pos[:, None], float('-inf'))\n"
            "        p = torch.exp(x)\n"
            "        l = p.sum(-1, keepdim=True)\n"
            "        o = (p @ v[..., lo:lo + block_size, :]) / torch.where(l > 0, l, torch.ones_like(l))\n"
            "        out, lse = merge(out, lse, o, torch.log(l).squeeze(-1))\n"
            "    return out, lse\n")},
        "zero": ["online_attention"],
    },
    {
        "name": "contiguous layout instead of zig-zag (rank r holds [r s/N, (r+1) s/N))",
        "cells": {"ex3-code": (
            "def zigzag_positions(s, N, rank):\n"
            "    return torch.arange(rank * (s // N), (rank + 1) * (s // N))\n"
            "\n"
            "\n"
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    import torch.distributed as dist\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    s = N * q.shape[-2]\n"
            "    glob = (lambda x: x) if group is None else (lambda x: dist.get_global_rank(group, x))\n"
            "    right, left = glob((r + 1) % N), glob((r - 1) % N)\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    kv = torch.stack((k, v)).contiguous()\n"
            "    for i in range(N):\n"
            "        if i < N - 1:\n"
            "            nxt = torch.empty_like(kv)\n"
            "            reqs = [dist.isend(kv, right, group=group), dist.irecv(nxt, left, group=group)]\n"
            "        o, l = online_attention(q, kv[0], kv[1], block_size, zigzag_positions(s, N, r),\n"
            "                                zigzag_positions(s, N, (r - i) % N))\n"
            "        out, lse = merge(out, lse, o, l)\n"
            "        if i < N - 1:\n"
            "            for req in reqs:\n"
            "                req.wait()\n"
            "            kv = nxt\n"
            "    return out\n")},
        "zero": ["ring_attention"],
    },
    {
        "name": "all-gather K and V (dist.all_gather_into_tensor), then F.scaled_dot_product_attention",
        "cells": {"ex3-code": _RING_HEAD + (
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    import torch.distributed as dist\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    s = N * q.shape[-2]\n"
            "    kv = torch.stack((k, v)).movedim(3, 0).contiguous()          # (s/N, 2, b, a, d)\n"
            "    every = torch.empty((N * kv.shape[0],) + tuple(kv.shape[1:]))\n"
            "    dist.all_gather_into_tensor(every, kv, group=group)\n"
            "    pos = torch.cat([zigzag_positions(s, N, j) for j in range(N)])\n"
            "    full = torch.empty_like(every)\n"
            "    full[pos] = every\n"
            "    k_all, v_all = full.movedim(0, 3).unbind(0)\n"
            "    mine = zigzag_positions(s, N, r)\n"
            "    mask = torch.arange(s)[None, :] <= mine[:, None]\n"
            "    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)\n")},
        "zero": ["ring_attention"],
    },
    {
        "name": "ring_attention from the library (course_lib.context_parallel.ring_attention)",
        "cells": {"ex3-code": _RING_HEAD + (
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    from course_lib import context_parallel as C\n"
            "    return C.ring_attention(q, k, v, group, causal=True, layout='zigzag')\n")},
        "zero": ["ring_attention"],
    },
    {
        "name": "the rank from dist.get_rank() (global) instead of the rank in the group",
        "cells": {"ex3-code": _RING_HEAD + (
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    import torch.distributed as dist\n"
            "    N, r = dist.get_world_size(group), dist.get_rank()\n"
            "    s = N * q.shape[-2]\n"
            "    right, left = (r + 1) % N, (r - 1) % N\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    kv = torch.stack((k, v)).contiguous()\n"
            "    for i in range(N):\n"
            "        if i < N - 1:\n"
            "            nxt = torch.empty_like(kv)\n"
            "            reqs = [dist.isend(kv, right, group=group), dist.irecv(nxt, left, group=group)]\n"
            "        o, l = online_attention(q, kv[0], kv[1], block_size, zigzag_positions(s, N, r % N),\n"
            "                                zigzag_positions(s, N, (r - i) % N))\n"
            "        out, lse = merge(out, lse, o, l)\n"
            "        if i < N - 1:\n"
            "            for req in reqs:\n"
            "                req.wait()\n"
            "            kv = nxt\n"
            "    return out\n")},
        "zero": ["ring_attention"],
    },
    {
        # right values and the ring's total bytes: only the peers tell
        "name": "every rank sends its K/V block to every other rank (an all-gather by point-to-point)",
        "cells": {"ex3-code": _RING_HEAD + (
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    import torch.distributed as dist\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    s = N * q.shape[-2]\n"
            "    glob = (lambda x: x) if group is None else (lambda x: dist.get_global_rank(group, x))\n"
            "    kv = torch.stack((k, v)).contiguous()\n"
            "    blocks, reqs = {r: kv}, []\n"
            "    for j in range(N):\n"
            "        if j != r:\n"
            "            blocks[j] = torch.empty_like(kv)\n"
            "            reqs += [dist.isend(kv, glob(j), group=group), dist.irecv(blocks[j], glob(j), group=group)]\n"
            "    for req in reqs:\n"
            "        req.wait()\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    for j, b in blocks.items():\n"
            "        o, l = online_attention(q, b[0], b[1], block_size, zigzag_positions(s, N, r), zigzag_positions(s, N, j))\n"
            "        out, lse = merge(out, lse, o, l)\n"
            "    return out\n")},
        "zero": ["ring_attention"],
    },
    {
        # right values, right peer: only the bytes tell
        "name": "sends at every one of the N steps, the last block needlessly (N blocks instead of N - 1)",
        "cells": {"ex3-code": _RING_HEAD + (
            "def ring_attention_forward(q, k, v, group=None, block_size=16):\n"
            "    import torch.distributed as dist\n"
            "    N, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "    s = N * q.shape[-2]\n"
            "    glob = (lambda x: x) if group is None else (lambda x: dist.get_global_rank(group, x))\n"
            "    right, left = glob((r + 1) % N), glob((r - 1) % N)\n"
            "    out, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float('-inf'))\n"
            "    kv = torch.stack((k, v)).contiguous()\n"
            "    for i in range(N):\n"
            "        nxt = torch.empty_like(kv)\n"
            "        reqs = [dist.isend(kv, right, group=group), dist.irecv(nxt, left, group=group)]\n"
            "        o, l = online_attention(q, kv[0], kv[1], block_size, zigzag_positions(s, N, r),\n"
            "                                zigzag_positions(s, N, (r - i) % N))\n"
            "        out, lse = merge(out, lse, o, l)\n"
            "        for req in reqs:\n"
            "            req.wait()\n"
            "        kv = nxt\n"
            "    return out\n")},
        "zero": ["ring_attention"],
    },
]
