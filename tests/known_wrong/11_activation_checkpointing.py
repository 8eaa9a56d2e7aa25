"""Shortcuts a learner would try in exercises/11_activation_checkpointing.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": 'calls torch.utils.checkpoint.checkpoint (switched off during the check)',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    pass\n\n\ndef checkpoint(fn, x):\n    import torch.utils.checkpoint as tc\n    return tc.checkpoint(fn, x, use_reentrant=False)\n'},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
    {
        "name": 'calls course_lib.recompute.checkpoint (switched off during the check)',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    pass\n\n\ndef checkpoint(fn, x):\n    from course_lib.recompute import checkpoint as reference\n    return reference(fn, x)\n'},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
    {
        "name": 'no recomputation: just fn(x) (right gradients, every activation kept, fn run once)',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    pass\n\n\ndef checkpoint(fn, x):\n    return fn(x)\n'},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
    {
        "name": 'forgets the RNG restore: the recomputation draws new dropout masks',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, fn, x):\n        ctx.fn = fn\n        ctx.save_for_backward(x)\n        return fn(x)\n\n    @staticmethod\n    def backward(ctx, grad_out):\n        (x,) = ctx.saved_tensors\n        x = x.detach().requires_grad_(True)\n        with torch.enable_grad():\n            out = ctx.fn(x)\n        torch.autograd.backward(out, grad_out)\n        return None, x.grad\n\n\ndef checkpoint(fn, x):\n    """fn(x), keeping only x for the backward; fn is re-run in the backward."""\n    return Checkpoint.apply(fn, x)\n'},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
    {
        "name": 'restores the RNG state without fork_rng: the global RNG ends in the wrong place',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, fn, x):\n        ctx.fn = fn\n        ctx.rng = torch.get_rng_state()\n        ctx.save_for_backward(x)\n        return fn(x)\n\n    @staticmethod\n    def backward(ctx, grad_out):\n        (x,) = ctx.saved_tensors\n        x = x.detach().requires_grad_(True)\n        torch.set_rng_state(ctx.rng)\n        with torch.enable_grad():\n            out = ctx.fn(x)\n        torch.autograd.backward(out, grad_out)\n        return None, x.grad\n\n\ndef checkpoint(fn, x):\n    """fn(x), keeping only x for the backward; fn is re-run in the backward."""\n    return Checkpoint.apply(fn, x)\n'},
        "zero": ['checkpoint_gradients'],
    },
    {
        "name": 'keeps the graph: runs fn with grad on in the forward and backpropagates through it later',
        "cells": {"ckpt-solution": 'class Checkpoint(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, fn, x):\n        ctx.x = x.detach().requires_grad_(True)\n        with torch.enable_grad():\n            ctx.out = fn(ctx.x)\n        return ctx.out.detach()\n\n    @staticmethod\n    def backward(ctx, grad_out):\n        torch.autograd.backward(ctx.out, grad_out)\n        return None, ctx.x.grad\n\n\ndef checkpoint(fn, x):\n    """fn(x), keeping only x for the backward; fn is re-run in the backward."""\n    return Checkpoint.apply(fn, x)\n'},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
]
