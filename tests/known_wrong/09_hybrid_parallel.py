"""Shortcuts a learner would try in exercises/09_hybrid_parallel.ipynb; each must score zero where listed.

``build_groups`` uses the learner's ``axis_groups``, so a wrong mesh arithmetic also breaks the process
groups: those cases list both checks. The cases are chosen so that they grade in two runs (disjoint cells
and checks per run): every run of this notebook starts 8 processes.
"""
COORDS = '''def mesh_coords(rank, shape):
{coords}


def axis_groups(shape, axis):
{groups}
'''
ROW_MAJOR_GROUPS = ("    stride = math.prod(shape[axis + 1:])\n"
                    "    return [[r + k * stride for k in range(shape[axis])]\n"
                    "            for r in range(math.prod(shape)) if mesh_coords(r, shape)[axis] == 0]")
LAYOUTS = '''def valid_layouts(n_layer, heads, hidden, global_batch, world_size):
{body}
'''
GROUPS = '''def build_groups(shape, names):
    import torch.distributed as dist
{body}
'''

CASES = [
    {
        "name": "column-major coordinates (the first axis varies fastest): tp groups become {0, 4}, ...",
        "cells": {"ex1-code": COORDS.format(
            coords=("    coords = []\n    for size in shape:\n        rank, c = divmod(rank, size)\n"
                    "        coords.append(c)\n    return tuple(coords)"),
            groups=("    stride = math.prod(shape[:axis])\n"
                    "    return [[r + k * stride for k in range(shape[axis])]\n"
                    "            for r in range(math.prod(shape)) if mesh_coords(r, shape)[axis] == 0]"))},
        "zero": ["mesh_coords", "process_groups"],
    },
    {
        "name": "forgets that the micro-batch must divide the replica's share of the batch",
        "cells": {"ex2-code": LAYOUTS.format(body=(
            "    out = []\n"
            "    for tp in range(1, world_size + 1):\n"
            "        if world_size % tp or heads % tp or hidden % tp:\n            continue\n"
            "        for pp in range(1, world_size // tp + 1):\n"
            "            if (world_size // tp) % pp or n_layer % pp:\n                continue\n"
            "            dp = world_size // (tp * pp)\n"
            "            if global_batch % dp:\n                continue\n"
            "            out += [(dp, tp, pp, b) for b in range(1, global_batch // dp + 1)]\n"
            "    return sorted(out)"))},
        "zero": ["valid_layouts"],
    },
    {
        "name": "asks the library's planner (course_lib.mesh.enumerate_layouts, switched off during the check)",
        "cells": {"ex2-code": LAYOUTS.format(body=(
            "    from course_lib import mesh as M\n"
            "    spec = M.ModelSpec('x', n_layer=n_layer, hidden=hidden, heads=heads, seq=8, vocab=8, global_batch=global_batch)\n"
            "    return [(l.dp, l.tp, l.pp, l.micro_batch) for l in M.enumerate_layouts(spec, world_size)]"))},
        "zero": ["valid_layouts"],
    },
    {
        "name": "lets torch build the mesh (init_device_mesh, switched off during the check)",
        "cells": {"ex3-code": GROUPS.format(body=(
            "    from torch.distributed.device_mesh import init_device_mesh\n"
            "    dm = init_device_mesh('cpu', shape, mesh_dim_names=names)\n"
            "    return {n: dm.get_group(n) for n in names}"))},
        "zero": ["process_groups"],
    },
]
