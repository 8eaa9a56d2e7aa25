"""Shortcuts a learner would try in exercises/07_tensor_parallel.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "f and g swapped (f all-reduces forward, g backward)",
        "cells": {"ex1-code": (
            "class CopyToTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        ctx.group = group\n"
            "        out = x.clone()\n"
            "        dist.all_reduce(out, group=group)\n"
            "        return out\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n"
            "\n"
            "\n"
            "class ReduceFromTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        ctx.group = group\n"
            "        return x.view_as(x)\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        grad = grad.clone()\n"
            "        dist.all_reduce(grad, group=ctx.group)\n"
            "        return grad, None\n")},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "f is the identity both ways (the input gradient is not summed)",
        "cells": {"ex1-code": (
            "class CopyToTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        ctx.group = group\n"
            "        return x.view_as(x)\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n"
            "\n"
            "\n"
            "class ReduceFromTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        ctx.group = group\n"
            "        out = x.clone()\n"
            "        dist.all_reduce(out, group=group)\n"
            "        return out\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n")},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "f and g from a reloaded course_lib.tensor_parallel (fresh copies of the switched-off operators) (kind 1)",
        "cells": {"ex1-code": (
            "import importlib\n"
            "import course_lib.tensor_parallel\n"
            "\n"
            "\n"
            "class CopyToTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        tp = importlib.reload(course_lib.tensor_parallel)\n"
            "        return tp.copy_to_tensor_parallel(x, group, builtin=True)\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n"
            "\n"
            "\n"
            "class ReduceFromTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        tp = importlib.reload(course_lib.tensor_parallel)\n"
            "        return tp.reduce_from_tensor_parallel(x, group, builtin=True)\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n")},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "g sums with the course's ring (point-to-point) and all-reduces one float to keep the count: right count, wrong size (kind 5)",
        "cells": {"ex1-code": (
            "class CopyToTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        ctx.group = group\n"
            "        return x.view_as(x)\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        grad = grad.clone()\n"
            "        dist.all_reduce(grad, group=ctx.group)\n"
            "        return grad, None\n"
            "\n"
            "\n"
            "class ReduceFromTP(torch.autograd.Function):\n"
            "    @staticmethod\n"
            "    def forward(ctx, x, group):\n"
            "        from course_lib.collectives import ring_all_reduce\n"
            "        out = ring_all_reduce(x.clone(), group=group)\n"
            "        dist.all_reduce(torch.zeros(1), group=group)\n"
            "        return out\n"
            "\n"
            "    @staticmethod\n"
            "    def backward(ctx, grad):\n"
            "        return grad, None\n")},
        "zero": ["conjugates", "tp_mlp"],
    },
    {
        "name": "keeps the full layers and computes the whole MLP on every rank (right numbers, nothing split)",
        "cells": {"ex2-code": (
            "class TPMLP(nn.Module):\n"
            "    def __init__(self, fc, fc_proj, group=None):\n"
            "        super().__init__()\n"
            "        self.group = group\n"
            "        self.w1 = nn.Parameter(fc.weight.detach().clone())\n"
            "        self.b1 = nn.Parameter(fc.bias.detach().clone())\n"
            "        self.w2 = nn.Parameter(fc_proj.weight.detach().clone())\n"
            "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())\n"
            "\n"
            "    def forward(self, x):\n"
            "        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)\n")},
        "zero": ["tp_mlp"],
    },
    {
        "name": "adds the replicated bias before the sum (b2 counted t times)",
        "cells": {"ex2-code": (
            "class TPMLP(nn.Module):\n"
            "    def __init__(self, fc, fc_proj, group=None):\n"
            "        super().__init__()\n"
            "        self.group = group\n"
            "        t, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "        k = fc.out_features // t\n"
            "        rows = slice(r * k, (r + 1) * k)\n"
            "        self.w1 = nn.Parameter(fc.weight.detach()[rows].clone())\n"
            "        self.b1 = nn.Parameter(fc.bias.detach()[rows].clone())\n"
            "        self.w2 = nn.Parameter(fc_proj.weight.detach()[:, rows].clone())\n"
            "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())\n"
            "\n"
            "    def forward(self, x):\n"
            "        hidden = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))\n"
            "        return ReduceFromTP.apply(F.linear(hidden, self.w2, self.b2), self.group)\n")},
        "zero": ["tp_mlp"],
    },
    {
        "name": "shards by the global rank dist.get_rank() instead of the rank in the group (kind 4)",
        "cells": {"ex2-code": (
            "class TPMLP(nn.Module):\n"
            "    def __init__(self, fc, fc_proj, group=None):\n"
            "        super().__init__()\n"
            "        self.group = group\n"
            "        t, r = dist.get_world_size(group), dist.get_rank()\n"
            "        k = fc.out_features // t\n"
            "        rows = slice(r * k, (r + 1) * k)\n"
            "        self.w1 = nn.Parameter(fc.weight.detach()[rows].clone())\n"
            "        self.b1 = nn.Parameter(fc.bias.detach()[rows].clone())\n"
            "        self.w2 = nn.Parameter(fc_proj.weight.detach()[:, rows].clone())\n"
            "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())\n"
            "\n"
            "    def forward(self, x):\n"
            "        hidden = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))\n"
            "        return ReduceFromTP.apply(F.linear(hidden, self.w2), self.group) + self.b2\n")},
        "zero": ["tp_mlp"],
    },
    {
        "name": "takes the forward's value from the check's reference in the caller's frame; an all-reduce of zeros of the right size keeps the count (kind 2)",
        "cells": {"ex2-code": (
            "class TPMLP(nn.Module):\n"
            "    def __init__(self, fc, fc_proj, group=None):\n"
            "        super().__init__()\n"
            "        self.group = group\n"
            "        t, r = dist.get_world_size(group), dist.get_rank(group)\n"
            "        k = fc.out_features // t\n"
            "        rows = slice(r * k, (r + 1) * k)\n"
            "        self.w1 = nn.Parameter(fc.weight.detach()[rows].clone())\n"
            "        self.b1 = nn.Parameter(fc.bias.detach()[rows].clone())\n"
            "        self.w2 = nn.Parameter(fc_proj.weight.detach()[:, rows].clone())\n"
            "        self.b2 = nn.Parameter(fc_proj.bias.detach().clone())\n"
            "\n"
            "    def forward(self, x):\n"
            "        hidden = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))\n"
            "        import sys\n"
            "        part = F.linear(hidden, self.w2) + self.b2\n"
            "        dist.all_reduce(torch.zeros_like(part), group=self.group)\n"
            "        f = sys._getframe(1)\n"
            "        while \"ref\" not in f.f_locals:\n"
            "            f = f.f_back\n"
            "        return part + (f.f_locals[\"ref\"].detach() - part).detach()\n")},
        "zero": ["tp_mlp"],
    },
]
