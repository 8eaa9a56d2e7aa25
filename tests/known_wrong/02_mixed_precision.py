"""Shortcuts a learner would try in exercises/02_mixed_precision.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "calls course_lib.precision.unscale_grads_",
        "cells": {"7e080906": "def unscale_and_check_(grads, scale):\n    return P.unscale_grads_(grads, scale)\n"},
        "zero": ["unscale_check"],
    },
    {
        "name": "calls torch's fused unscale op",
        "cells": {"7e080906": (
            "def unscale_and_check_(grads, scale):\n"
            "    gs = [g for g in grads if g is not None]\n"
            "    found = torch.zeros(1)\n"
            "    torch._amp_foreach_non_finite_check_and_unscale_(gs, found, torch.tensor(1.0 / scale))\n"
            "    return bool(found.item())\n")},
        "zero": ["unscale_check"],
    },
    {
        "name": "divides by the scale (not GradScaler's FP32 reciprocal)",
        "cells": {"7e080906": (
            "def unscale_and_check_(grads, scale):\n"
            "    found_inf = False\n"
            "    for g in grads:\n"
            "        if g is None:\n            continue\n"
            "        found_inf |= not bool(torch.isfinite(g).all())\n"
            "        g.div_(scale)\n"
            "    return found_inf\n")},
        "zero": ["unscale_check"],
    },
    {
        "name": "update delegates to course_lib.precision.update_scale",
        "cells": {"30d71667": (
            "class MyDynamicScaler:\n"
            "    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):\n"
            "        self.scale, self.growth_tracker = float(init_scale), 0\n"
            "        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval\n"
            "    def update(self, found_inf):\n"
            "        self.scale, self.growth_tracker = P.update_scale(self.scale, self.growth_tracker, found_inf,\n"
            "                                                         self.growth_factor, self.backoff_factor, self.growth_interval)\n")},
        "zero": ["scaler_update"],
    },
    {
        "name": "grows the scale without the FP32 rounding and the inf guard",
        "cells": {"30d71667": (
            "class MyDynamicScaler:\n"
            "    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):\n"
            "        self.scale, self.growth_tracker = float(init_scale), 0\n"
            "        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval\n"
            "    def update(self, found_inf):\n"
            "        if found_inf:\n"
            "            self.scale *= self.backoff_factor; self.growth_tracker = 0; return\n"
            "        self.growth_tracker += 1\n"
            "        if self.growth_tracker == self.growth_interval:\n"
            "            self.scale *= self.growth_factor; self.growth_tracker = 0\n")},
        "zero": ["scaler_update"],
    },
    {
        "name": "master_step of a reloaded course_lib.precision (kind 1)",
        "cells": {"010c8f65": (
            "def my_master_step(model_params, master_params, optimizer, scaler):\n"
            "    return __import__('importlib').reload(P).master_step(model_params, master_params, optimizer, scaler)\n")},
        "zero": ["master_step"],
    },
    {
        "name": "steps the masters but never copies them back into the FP16 model",
        "cells": {"010c8f65": (
            "def my_master_step(model_params, master_params, optimizer, scaler):\n"
            "    with torch.no_grad():\n"
            "        for p, m in zip(model_params, master_params):\n"
            "            m.grad = None if p.grad is None else p.grad.float()\n"
            "        found_inf = scaler.unscale_([m.grad for m in master_params])\n"
            "        if not found_inf:\n            optimizer.step()\n"
            "        scaler.update(found_inf)\n"
            "        for p in model_params:\n            p.grad = None\n"
            "    return not found_inf\n")},
        "zero": ["master_step"],
    },
]
