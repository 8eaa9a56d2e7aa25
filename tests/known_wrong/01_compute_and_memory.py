"""Shortcuts a learner would try in exercises/01_compute_and_memory.ipynb; each must score zero where listed."""
CASES = [
    {
        "name": "transformer_layer_flops of a reloaded course_lib.estimate (kind 1)",
        "cells": {"1af529f9": (
            "def transformer_layer_flops(h, s, b):\n"
            "    return jnp.vectorize(lambda h, s, b: float(__import__('importlib').reload(E).transformer_layer_flops(int(b), int(s), int(h))))(\n"
            "        jnp.asarray(h), jnp.asarray(s), jnp.asarray(b))\n")},
        "zero": ["layer_flops"],
    },
    {
        "name": "forgets the attention scores (no s^2 term)",
        "cells": {"1af529f9": (
            "def transformer_layer_flops(h, s, b):\n"
            "    h, s, b = (jnp.asarray(v, jnp.float32) for v in (h, s, b))\n"
            "    return 24 * b * s * h * h\n")},
        "zero": ["layer_flops", "training_cost"],   # training_cost uses the learner's layer FLOPs
    },
    {
        "name": "activation_bytes_per_layer of a second copy of course_lib/estimate.py (kind 1)",
        "cells": {"cf22a21b": (
            "def transformer_layer_activation_bytes(h, s, b, heads):\n"
            "    import importlib.util\n"
            "    spec = importlib.util.spec_from_file_location('my_estimate', E.__file__)\n"
            "    E2 = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(E2)\n"
            "    return jnp.vectorize(lambda h, s, b, a: float(E2.activation_bytes_per_layer(int(s), int(b), int(h), int(a))))(\n"
            "        jnp.asarray(h), jnp.asarray(s), jnp.asarray(b), jnp.asarray(heads))\n")},
        "zero": ["activation_bytes"],
    },
    {
        "name": "calls course_lib.estimate's largest_model_that_fits",
        "cells": {"501443d0": (
            "def largest_model(gpu_bytes, zero_stage, n_devices, reserved_bytes=0.0, k=12):\n"
            "    opt = {12: 'adam', 8: 'sgd_momentum'}[k]\n"
            "    return jnp.array([E.largest_model_that_fits(gpu_bytes, zero_stage, int(N), optimizer=opt,\n"
            "                                                reserved_bytes=reserved_bytes)\n"
            "                      for N in jnp.atleast_1d(jnp.asarray(n_devices))]).squeeze()\n")},
        "zero": ["largest_model", "budget_answer"],
    },
    {
        "name": "hard-codes the budget answer, rounded",
        "cells": {"6e8a5af5": "answer_billion = 27.0\nprint(answer_billion)"},
        "zero": ["budget_answer"],
    },
    {
        "name": "the parameter count from course_lib.hybrid_gpt.hybrid_param_count (the same formula in another module) (kind 3)",
        "cells": {"96cc6f74": (
            "def training_cost(h, s, b, L, heads, vocab):\n"
            "    from course_lib.hybrid_gpt import hybrid_param_count\n"
            "    params = hybrid_param_count(L, h, vocab, s, tp=1, pp=1)[\"total\"]\n"
            "    lm_head = 2 * jnp.asarray(b, jnp.float32) * s * h * vocab\n"
            "    flops = 3 * (L * transformer_layer_flops(h, s, b) + lm_head)\n"
            "    act = L * transformer_layer_activation_bytes(h, s, b, heads)\n"
            "    states = 16.0 * params\n"
            "    return {\"params\": params, \"flops_per_step\": flops, \"activation_bytes\": act,\n"
            "            \"model_state_bytes\": states, \"total_bytes\": states + act}\n")},
        "zero": ["training_cost"],
    },
    {
        "name": "6 FLOPs per parameter per token (Kaplan's 6N) instead of counting the layers",
        "cells": {"96cc6f74": (
            "def training_cost(h, s, b, L, heads, vocab):\n"
            "    params = L * (12 * h * h + 13 * h) + vocab * h + s * h + 2 * h\n"
            "    act = L * transformer_layer_activation_bytes(h, s, b, heads)\n"
            "    states = 16.0 * params\n"
            "    return {'params': params, 'flops_per_step': 6.0 * params * b * s, 'activation_bytes': act,\n"
            "            'model_state_bytes': states, 'total_bytes': states + act}\n")},
        "zero": ["training_cost"],
    },
]
