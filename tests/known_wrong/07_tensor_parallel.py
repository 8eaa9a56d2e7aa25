"""Shortcuts a learner would try in exercises/07_tensor_parallel.ipynb; each must score zero where listed.

A wrong f or g also breaks the MLP built from them, so those cases list both checks.
"""
F_G = '''class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
{f_fwd}

    @staticmethod
    def backward(ctx, grad):
{f_bwd}


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
{g_fwd}

    @staticmethod
    def backward(ctx, grad):
{g_bwd}
'''
ALL_REDUCE_X = "        ctx.group = group\n        out = x.clone()\n        dist.all_reduce(out, group=group)\n        return out"
ALL_REDUCE_GRAD = "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None"
IDENTITY_X = "        ctx.group = group\n        return x.view_as(x)"
IDENTITY_GRAD = "        return grad, None"

MLP = '''class TPMLP(nn.Module):
    def __init__(self, fc, fc_proj, group=None):
        super().__init__()
        self.group = group
{init}

    def forward(self, x):
{forward}
'''
SHARDS = ("        t, r = dist.get_world_size(group), dist.get_rank(group)\n"
          "        k = fc.out_features // t\n        rows = slice(r * k, (r + 1) * k)\n"
          "        self.w1 = nn.Parameter(fc.weight.detach()[rows].clone())\n"
          "        self.b1 = nn.Parameter(fc.bias.detach()[rows].clone())\n"
          "        self.w2 = nn.Parameter(fc_proj.weight.detach()[:, rows].clone())\n"
          "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())")

CASES = [
    {
        "name": "f and g swapped (f all-reduces forward, g backward)",
        "cells": {"ex1-code": F_G.format(f_fwd=ALL_REDUCE_X, f_bwd=IDENTITY_GRAD, g_fwd=IDENTITY_X, g_bwd=ALL_REDUCE_GRAD)},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "f is the identity both ways (the input gradient is not summed)",
        "cells": {"ex1-code": F_G.format(f_fwd=IDENTITY_X, f_bwd=IDENTITY_GRAD, g_fwd=ALL_REDUCE_X, g_bwd=IDENTITY_GRAD)},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "calls course_lib.tensor_parallel's operators (switched off during the check)",
        "cells": {"ex1-code": F_G.format(
            f_fwd="        from course_lib.tensor_parallel import copy_to_tensor_parallel as f\n"
                  "        ctx.group = group\n        return f(x, group)",
            f_bwd=IDENTITY_GRAD,
            g_fwd="        from course_lib.tensor_parallel import reduce_from_tensor_parallel as g\n"
                  "        return g(x, group)",
            g_bwd=IDENTITY_GRAD)},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "keeps the full layers and computes the whole MLP on every rank (right numbers, nothing split)",
        "cells": {"ex2-code": MLP.format(
            init="        self.w1 = nn.Parameter(fc.weight.detach().clone())\n"
                 "        self.b1 = nn.Parameter(fc.bias.detach().clone())\n"
                 "        self.w2 = nn.Parameter(fc_proj.weight.detach().clone())\n"
                 "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())",
            forward="        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)")},
        "zero": ["tp_mlp"],
    },
    {
        "name": "adds the replicated bias before the sum (b2 counted t times)",
        "cells": {"ex2-code": MLP.format(
            init=SHARDS,
            forward="        hidden = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))\n"
                    "        return ReduceFromTP.apply(F.linear(hidden, self.w2, self.b2), self.group)")},
        "zero": ["tp_mlp"],
    },
]
