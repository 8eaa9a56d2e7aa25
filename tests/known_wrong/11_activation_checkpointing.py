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
CASES += [
    {
        # issue 25, kind 2: the reference gradients were notebook globals while the learner's backward ran
        "name": "new dropout masks in the recomputation, then copies the check's reference gradients from the notebook's globals",
        "cells": {"ckpt-solution": '''class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        import sys
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):     # the global RNG ends right; the masks are new ones
            with torch.enable_grad():
                out = ctx.fn(x)
        torch.autograd.backward(out, grad_out)
        f = sys._getframe(1)
        while f is not None and "model" not in f.f_locals:
            f = f.f_back
        if f is not None:                           # the check's step(model, ckpt, x, ...)
            model, xin = f.f_locals["model"], f.f_locals["x"]
            shapes = [xin.shape] + [p.shape for p in model.parameters()]
            for ref in list(globals().values()):    # a list of gradients shaped like [x] + parameters
                if (isinstance(ref, list) and len(ref) == len(shapes)
                        and all(isinstance(r, torch.Tensor) and r.shape == s for r, s in zip(ref, shapes))):
                    for p, r in zip(model.parameters(), ref[1:]):
                        p.grad = r.clone()
                    return None, ref[0].clone()
        return None, x.grad


def checkpoint(fn, x):
    return Checkpoint.apply(fn, x)
'''},
        "zero": ['checkpoint_gradients', 'checkpoint_memory'],
    },
    {
        # issue 25, kind 5: nothing modified the input in place between forward and backward
        "name": "keeps x as an attribute of ctx instead of save_for_backward: an in-place change of x goes unnoticed",
        "cells": {"ckpt-solution": '''class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        ctx.x = x
        return fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.x.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                out = ctx.fn(x)
        torch.autograd.backward(out, grad_out)
        return None, x.grad


def checkpoint(fn, x):
    return Checkpoint.apply(fn, x)
'''},
        "zero": ['checkpoint_gradients'],
    },
]
