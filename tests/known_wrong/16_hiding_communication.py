"""Shortcuts a learner would try in exercises/16_hiding_communication.ipynb; each must score zero where listed."""

_HEAD = (
    "def all_gather_matmul(x, w, group=None, transport=None, mm=torch.matmul):\n"
    "    tr = dist if transport is None else transport\n"
    "    t, r = dist.get_world_size(group), dist.get_rank(group)\n"
    "    glob = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))\n"
    "    right, left = glob((r + 1) % t), glob((r - 1) % t)\n"
    "    rows = x.shape[0]\n"
    "    out = torch.empty(t * rows, w.shape[1])\n"
    "    held = x.contiguous()\n"
)

CASES = [
    {
        # right values, right sends: one product of all n rows, after the whole gather
        "name": "gathers every chunk around the ring first, then one matmul of all n rows",
        "cells": {"ex1-code": _HEAD + (
            "    full = torch.empty(t * rows, x.shape[1])\n"
            "    full[r * rows:(r + 1) * rows] = held\n"
            "    for k in range(t - 1):\n"
            "        nxt = torch.empty_like(held)\n"
            "        reqs = [tr.isend(held, right, group=group), tr.irecv(nxt, left, group=group)]\n"
            "        for q in reqs:\n"
            "            q.wait()\n"
            "        held = nxt\n"
            "        src = (r - k - 1) % t\n"
            "        full[src * rows:(src + 1) * rows] = held\n"
            "    return mm(full, w)\n")},
        "zero": ["collective_matmul", "overlap"],
    },
    {
        # right values: only the bytes tell
        "name": "sends everything gathered so far at every step (growing messages, not one chunk)",
        "cells": {"ex1-code": _HEAD + (
            "    have = held\n"
            "    for k in range(t):\n"
            "        src = (r - k) % t\n"
            "        out[src * rows:(src + 1) * rows] = mm(have[-rows:], w)\n"
            "        if k < t - 1:\n"
            "            nxt = torch.empty(rows * (k + 2), x.shape[1])\n"
            "            mine = torch.cat([have, have[-rows:]]).contiguous()\n"
            "            reqs = [tr.isend(mine, right, group=group), tr.irecv(nxt, left, group=group)]\n"
            "            for q in reqs:\n"
            "                q.wait()\n"
            "            have = nxt\n"
            "    return out\n")},
        "zero": ["collective_matmul"],
    },
    {
        # right values, right sends, t products: only the timing tells
        "name": "waits for each hop before multiplying (blocking: nothing overlaps)",
        "cells": {"ex1-code": _HEAD + (
            "    for k in range(t):\n"
            "        src = (r - k) % t\n"
            "        if k < t - 1:\n"
            "            nxt = torch.empty_like(held)\n"
            "            reqs = [tr.isend(held, right, group=group), tr.irecv(nxt, left, group=group)]\n"
            "            for q in reqs:\n"
            "                q.wait()\n"
            "        out[src * rows:(src + 1) * rows] = mm(held, w)\n"
            "        if k < t - 1:\n"
            "            held = nxt\n"
            "    return out\n")},
        "zero": ["overlap"],
    },
    {
        "name": "the rank from dist.get_rank() (global) instead of the rank in the group",
        "cells": {"ex1-code": (
            "def all_gather_matmul(x, w, group=None, transport=None, mm=torch.matmul):\n"
            "    tr = dist if transport is None else transport\n"
            "    t, r = dist.get_world_size(group), dist.get_rank()\n"
            "    glob = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))\n"
            "    right, left = glob((r + 1) % t), glob((r - 1) % t)\n"
            "    rows = x.shape[0]\n"
            "    out = torch.empty(t * rows, w.shape[1])\n"
            "    held = x.contiguous()\n"
            "    for k in range(t):\n"
            "        src = (r - k) % t\n"
            "        if k < t - 1:\n"
            "            nxt = torch.empty_like(held)\n"
            "            reqs = [tr.isend(held, right, group=group), tr.irecv(nxt, left, group=group)]\n"
            "        out[src * rows:(src + 1) * rows] = mm(held, w)\n"
            "        if k < t - 1:\n"
            "            for q in reqs:\n"
            "                q.wait()\n"
            "            held = nxt\n"
            "    return out\n")},
        "zero": ["collective_matmul"],
    },
    {
        "name": "torch's all-gather, then one matmul",
        "cells": {"ex1-code": (
            "def all_gather_matmul(x, w, group=None, transport=None, mm=torch.matmul):\n"
            "    t = dist.get_world_size(group)\n"
            "    full = torch.empty(t * x.shape[0], x.shape[1])\n"
            "    dist.all_gather_into_tensor(full, x.contiguous(), group=group)\n"
            "    return mm(full, w)\n")},
        "zero": ["collective_matmul"],
    },
    {
        "name": "the library's collective matmul (course_lib.overlap.all_gather_matmul)",
        "cells": {"ex1-code": (
            "def all_gather_matmul(x, w, group=None, transport=None, mm=torch.matmul):\n"
            "    from course_lib import overlap\n"
            "    return overlap.all_gather_matmul(x, w, group, transport=transport, mm=mm)\n")},
        "zero": ["collective_matmul"],
    },
    {
        # right values, sends and overlap on loopback: the emulated link never sees the sends
        "name": "sends with dist.isend directly, ignoring `transport`",
        "cells": {"ex1-code": _HEAD.replace("tr = dist if transport is None else transport", "tr = dist") + (
            "    for k in range(t):\n"
            "        src = (r - k) % t\n"
            "        if k < t - 1:\n"
            "            nxt = torch.empty_like(held)\n"
            "            reqs = [tr.isend(held, right, group=group), tr.irecv(nxt, left, group=group)]\n"
            "        out[src * rows:(src + 1) * rows] = mm(held, w)\n"
            "        if k < t - 1:\n"
            "            for q in reqs:\n"
            "                q.wait()\n"
            "            held = nxt\n"
            "    return out\n")},
        "zero": ["overlap"],
    },
]
