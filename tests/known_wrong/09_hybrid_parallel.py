"""Shortcuts a learner would try in exercises/09_hybrid_parallel.ipynb; each must score zero where listed.

``build_groups`` uses the learner's ``axis_groups``, so a wrong mesh arithmetic also breaks the process
groups: those cases list both checks. The cases are ordered so that they grade in four runs (disjoint cells
and checks per run): every run that reaches ``process_groups`` starts 8 processes.
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
        # issue 25, kind 2: the checks called the learner's functions while the expected values were
        # locals of the calling frames and the reference (_truth) a notebook global
        "name": "reads the answers from the check: the caller's frames (expected coordinates, layouts) or its _truth",
        "cells": {
            "ex1-code": COORDS.format(
                coords=("    import sys\n"
                        "    f = sys._getframe(1)\n"
                        "    while f is not None:\n"
                        "        for v in list(f.f_locals.values()):\n"
                        "            if isinstance(v, dict) and rank in v and isinstance(v[rank], tuple):\n"
                        "                return v[rank]\n"
                        "        f = f.f_back\n"
                        "    return globals()['_truth'](shape)[0][rank]"),
                groups=("    stride = math.prod(shape[axis + 1:])\n"
                        "    return [[r + k * stride for k in range(shape[axis])]\n"
                        "            for r in range(math.prod(shape)) if (r // stride) % shape[axis] == 0]")),
            "ex2-code": LAYOUTS.format(body=(
                "    import sys\n"
                "    f = sys._getframe(1)\n"
                "    while f is not None:\n"
                "        if isinstance(f.f_locals.get('want'), list):\n"
                "            return f.f_locals['want']\n"
                "        f = f.f_back\n"
                "    return []")),
        },
        "zero": ["mesh_coords", "valid_layouts"],
    },
    {
        "name": "lets torch build the mesh (init_device_mesh, switched off during the check)",
        "cells": {"ex3-code": GROUPS.format(body=(
            "    from torch.distributed.device_mesh import init_device_mesh\n"
            "    dm = init_device_mesh('cpu', shape, mesh_dim_names=names)\n"
            "    return {n: dm.get_group(n) for n in names}"))},
        "zero": ["process_groups"],
    },
    {
        # issue 25, kind 3: numpy's index helpers give the arithmetic the text asks for
        "name": "numpy's index helpers: np.unravel_index for the coordinates, an arange reshaped for the groups",
        "cells": {"ex1-code": COORDS.format(
            coords="    import numpy as np\n    return tuple(int(c) for c in np.unravel_index(rank, shape))",
            groups=("    import numpy as np\n"
                    "    grid = np.moveaxis(np.arange(math.prod(shape)).reshape(shape), axis, -1)\n"
                    "    return [[int(r) for r in g] for g in grid.reshape(-1, shape[axis])]"))},
        "zero": ["mesh_coords"],   # in the ranks numpy is allowed: build_groups gets correct lists
    },
    {
        "name": "asks the library's planner (course_lib.planner.enumerate_layouts, switched off during the check)",
        "cells": {"ex2-code": LAYOUTS.format(body=(
            "    from course_lib import planner\n"
            "    spec = planner.ModelSpec('x', n_layer=n_layer, hidden=hidden, heads=heads, seq=8, vocab=8, global_batch=global_batch)\n"
            "    return [(l.dp, l.tp, l.pp, l.micro_batch) for l in planner.enumerate_layouts(spec, world_size)]"))},
        "zero": ["valid_layouts"],
    },
    {
        # issue 25, kind 3: torch's group-enumeration API makes the groups
        "name": "torch's group enumeration: dist.new_subgroups_by_enumeration(axis_groups(...)) per axis",
        "cells": {"ex3-code": GROUPS.format(body=(
            "    return {name: dist.new_subgroups_by_enumeration(axis_groups(shape, a))[0]\n"
            "            for a, name in enumerate(names)}"))},
        "zero": ["process_groups"],
    },
    {
        # the checks used names the learner's own cells can rebind: _guarded (the guard) and cluster
        "name": "switches the check's machinery off from its own cells: _guarded rebound, a fake cluster",
        "cells": {
            "ex2-code": "import contextlib\n\n\ndef _guarded():\n    return contextlib.nullcontext()\n\n\n" + LAYOUTS.format(body=(
                "    from course_lib import planner\n"
                "    spec = planner.ModelSpec('x', n_layer=n_layer, hidden=hidden, heads=heads, seq=8, vocab=8, global_batch=global_batch)\n"
                "    return [(l.dp, l.tp, l.pp, l.micro_batch) for l in planner.enumerate_layouts(spec, world_size)]")),
            "ex3-code": GROUPS.format(body="    return {}") + (
                "\n\nclass _AgreeingCluster:\n"
                "    def run(self, fn, build, shape, names, timeout=None):\n"
                "        same = {n: [0] for n in names}\n"
                "        return [(same, same, {n: 0.0 for n in names})] * 8\n"
                "\n\ncluster = _AgreeingCluster()\n"),
        },
        "zero": ["valid_layouts", "process_groups"],
    },
]
