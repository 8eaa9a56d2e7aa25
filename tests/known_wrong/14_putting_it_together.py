"""Shortcuts a learner would try in exercises/14_putting_it_together.ipynb; each must score zero where listed."""
MEMORY = '''def memory_per_gpu(model, layout, zero_stage, recompute):
    d, t, p = layout.dp, layout.tp, layout.pp
    psi = model.n_params / (t * p)
    params, grads, optim = 2 * psi, 2 * psi, 12 * psi
    if zero_stage >= 1:
        optim /= d
    if zero_stage >= 2:
        grads /= d
    if zero_stage >= {param_stage}:
        params /= d
    s, b, h, a = model.seq, layout.micro_batch, model.hidden, model.heads
    per_layer = {{"none": s * b * h * (34 / t + 5 * a * s / (h * t)),
                 "selective": 34 * s * b * h / t,
                 "full": {full}}}[recompute]
    activations = model.n_layer / p * {in_flight} * per_layer
    return params + grads + optim + activations
'''
MEM_OK = dict(param_stage=3, full="2 * s * b * h", in_flight="min(p, layout.m)")

TRAFFIC = '''def traffic_per_gpu(model, layout, stage, bytes_per_value=2):
    def ring(nbytes, n):
        return {ring}
    b, s, h = layout.micro_batch, model.seq, model.hidden
    t, p, m = layout.tp, layout.pp, layout.m
    first, last = stage == 0, stage == p - 1
    msg = b * s * h * bytes_per_value
    tp = m * ({per_layer} * model.n_layer / p + first + last) * ring(msg, t) + last * m * 2 * ring(b * s * bytes_per_value, t)
    neighbours = (not first) + (not last) if p > 1 else 0
    return {{"tp": tp, "pp": neighbours * m * msg,
            "dp": ring(model.n_params / (t * p) * bytes_per_value, layout.dp)}}
'''
TRAFFIC_OK = dict(ring="2 * (n - 1) / n * nbytes", per_layer=4)

STEP = '''def step_seconds(model, cluster, layout, zero_stage, recompute):
    d, t, p, b, m = layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.m
    s, h, L, V = model.seq, model.hidden, model.n_layer, model.vocab
    g = cluster.gpus_per_node

    def inside(stride, size):
        world = d * t * p
        return {inside}

    def link(stride, size):
        return ((cluster.intra_bw, cluster.intra_latency) if inside(stride, size)
                else (cluster.inter_bw, cluster.inter_latency))

    def all_reduce(nbytes, n, bw, alpha):
        return 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw

    c = 3 * (L * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V) / (t * p) / (
        cluster.peak_flops * cluster.efficiency)
    msg = b * s * h * 2
    c_t = (4 * L / p + 1 + (p == 1)) * all_reduce(msg, t, *link(1, t))
    bw, alpha = link(t, p)
    hop = 2 * (alpha + msg / bw) if p > 1 else 0.0
    out = {{"compute": m * c, "tp": m * c_t, "pp": (m + p - 1) * hop, "bubble": (p - 1) * (c + c_t),
           "dp": all_reduce(model.n_params / (t * p) * 2, d, *link(t * p, d))}}
    if recompute == "full":
        out["compute"] *= {full}
        out["bubble"] *= {full}
    if zero_stage == 3:
        out["dp"] *= {zero3}
    out["step"] = sum(out.values())
    return out
'''
STEP_OK = dict(inside="all(f // g == (f + (size - 1) * stride) // g for f in range(world) if (f // stride) % size == 0)",
               full="4 / 3", zero3="1.5")

CHOOSE = '''SETTINGS = [(z, r) for z in (0, 1, 2, 3) for r in ("none", "selective", "full")]

def choose_layout(model, cluster):
{body}
'''
MEASURE_HEAD = '''tiny = planner.ModelSpec("tiny GPT, 4 heads", n_layer=2, hidden=32, heads=4, seq=16, vocab=64, global_batch=16,
                         n_params=sum(p.numel() for p in hybrid_gpt.make_model(heads=4).parameters()))
virtual = planner.ClusterSpec("virtual cluster: 2 x 2 processes", nodes=2, gpus_per_node=2, memory=1e9,
                              peak_flops=3e9, efficiency=1.0, intra_bw=2e9, inter_bw=0.5e9,
                              intra_latency=5e-4, inter_latency=1e-3)

def metered_step(rank, world_size, dp, pp, tp, m):
{body}
'''
METER = '''    pm = M.init_process_mesh((dp, pp, tp))
    h = hybrid_gpt.HybridGPT(hybrid_gpt.make_model(heads=4), pm)
    (x, y), = hybrid_gpt.make_batches(1)
    with M.CommMeter(h.comm_groups()) as meter:
        h.forward_backward(x, y, {n_micro})
    return {{"stage": h.stage, **{{a: int({count}) for a in ("tp", "pp", "dp")}}}}'''

COST = '''def cost_estimate(n_params, tokens, peak_flops, mfu, gpu_hour_price, gpu_power_watts, pue):
{body}
'''
HOURS = "    gpu_hours = {flops} / ({rate}) / 3600\n"
BILL = ("    return {{'gpu_hours': gpu_hours, 'dollars': gpu_hours * gpu_hour_price,\n"
        "            'energy_kwh': gpu_hours * gpu_power_watts / 1000{pue}}}")

CASES = [
    # ---- exercise 1: memory
    {
        "name": "ZeRO-3 counted like ZeRO-2 (the bf16 parameters left unsharded)",
        "cells": {"ex-memory": MEMORY.format(**{**MEM_OK, "param_stage": 4})},
        "zero": ["memory_per_gpu"],
    },
    {
        "name": "full recomputation keeps as much as selective (its saving ignored)",
        "cells": {"ex-memory": MEMORY.format(**{**MEM_OK, "full": "34 * s * b * h / t"})},
        "zero": ["memory_per_gpu"],
    },
    {
        "name": "all m micro-batches in flight (GPipe's count, not 1F1B's min(p, m))",
        "cells": {"ex-memory": MEMORY.format(**{**MEM_OK, "in_flight": "layout.m"})},
        "zero": ["memory_per_gpu"],
    },
    {
        "name": "calls the planner's layout_memory (switched off during the check)",
        "cells": {"ex-memory": ("def memory_per_gpu(model, layout, zero_stage, recompute):\n"
                                "    return planner.layout_memory(model, layout, zero_stage, recompute=recompute, grad_bytes=2)['total']\n")},
        "zero": ["memory_per_gpu"],
    },
    # ---- exercise 2: traffic
    {
        "name": "a ring all-reduce sends its whole buffer once (no 2(N-1)/N)",
        "cells": {"ex-traffic": TRAFFIC.format(**{**TRAFFIC_OK, "ring": "nbytes if n > 1 else 0.0"})},
        "zero": ["traffic_per_gpu"],
    },
    {
        "name": "2 tp all-reduces per layer (the forward's only)",
        "cells": {"ex-traffic": TRAFFIC.format(**{**TRAFFIC_OK, "per_layer": 2})},
        "zero": ["traffic_per_gpu"],
    },
    {
        "name": "the ring's bytes from ZeRO's per-step formula (course_lib.zero.comm_bytes_per_step, switched off)",
        "cells": {"ex-traffic": TRAFFIC.format(**{**TRAFFIC_OK, "ring": (
            "__import__('course_lib.zero', fromlist=['zero']).comm_bytes_per_step(nbytes, 0, n, 1)")})},
        "zero": ["traffic_per_gpu"],
    },
    {
        "name": "calls the planner's layout_traffic (switched off during the check)",
        "cells": {"ex-traffic": ("def traffic_per_gpu(model, layout, stage, bytes_per_value=2):\n"
                                 "    return planner.layout_traffic(model, layout, stage, bytes_per_value)\n")},
        "zero": ["traffic_per_gpu"],
    },
    # ---- exercise 3: step time (the choice built on it goes wrong too)
    {
        "name": "leaves full recomputation's extra forward out",
        "cells": {"ex-step": STEP.format(**{**STEP_OK, "full": "1.0"})},
        "zero": ["step_seconds", "choose_layout"],
    },
    {
        "name": "leaves ZeRO-3's extra all-gather out",
        "cells": {"ex-step": STEP.format(**{**STEP_OK, "zero3": "1.0"})},
        "zero": ["step_seconds", "choose_layout"],
    },
    {
        "name": "every axis on NVLink (node boundaries ignored)",
        "cells": {"ex-step": STEP.format(**{**STEP_OK, "inside": "True"})},
        "zero": ["step_seconds", "choose_layout"],
    },
    {
        "name": "calls the planner's layout_step_time (switched off during the check)",
        "cells": {"ex-step": ("def step_seconds(model, cluster, layout, zero_stage, recompute):\n"
                              "    t = planner.layout_step_time(model, cluster, layout)\n"
                              "    if recompute == 'full':\n        t['compute'] *= 4 / 3; t['bubble'] *= 4 / 3\n"
                              "    if zero_stage == 3:\n        t['dp'] *= 1.5\n"
                              "    t['step'] = t['compute'] + t['tp'] + t['pp'] + t['bubble'] + t['dp']\n"
                              "    return t\n")},
        "zero": ["step_seconds", "choose_layout"],
    },
    # ---- exercise 4: the decision
    {
        "name": "pure data parallelism, nothing sharded (does not fit: GPT-3's states alone are 2.8 TB per copy)",
        "cells": {"ex-choose": CHOOSE.format(body=(
            "    dp = cluster.world_size\n"
            "    return planner.Layout(dp, 1, 1, 1, model.global_batch // dp), 0, 'none'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "asks the library's planner (course_lib.planner.plan_layouts, switched off during the check)",
        "cells": {"ex-choose": CHOOSE.format(body="    return planner.plan_layouts(model, cluster)[0], 1, 'selective'")},
        "zero": ["choose_layout"],
    },
    {
        "name": "always ZeRO-1 with selective recomputation (the fastest layout that fits with them)",
        "cells": {"ex-choose": CHOOSE.format(body=(
            "    fit = [l for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8))\n"
            "           if memory_per_gpu(model, l, 1, 'selective') <= 0.9 * cluster.memory]\n"
            "    return min(fit, key=lambda l: step_seconds(model, cluster, l, 1, 'selective')['step']), 1, 'selective'"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "the choice with the least memory (fits, but ignores the step time)",
        "cells": {"ex-choose": CHOOSE.format(body=(
            "    cands = [(memory_per_gpu(model, l, z, r), l, z, r)\n"
            "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS]\n"
            "    return min(cands, key=lambda c: c[0])[1:]"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "the fastest layout ignoring memory (does not fit)",
        "cells": {"ex-choose": CHOOSE.format(body=(
            "    cands = [(step_seconds(model, cluster, l, z, r)['step'], l, z, r)\n"
            "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z, r in SETTINGS]\n"
            "    return min(cands, key=lambda c: c[0])[1:]"))},
        "zero": ["choose_layout"],
    },
    {
        "name": "a recompute value that is 'full' where memory is counted and 'none' where time is (it reads its callers' frames)",
        "cells": {"ex-choose": (
            "class Chameleon:\n"
            "    def __eq__(self, other):\n"
            "        import sys\n"
            "        f, names = sys._getframe(1), set()\n"
            "        while f is not None:\n"
            "            names.add(f.f_code.co_name); f = f.f_back\n"
            "        return other == ('full' if names & {'layout_memory', 'memory_per_gpu', '_fits', 'activation_bytes_per_layer'} else 'none')\n"
            "    __hash__ = object.__hash__\n"
            "    def __repr__(self):\n        return \"'full'\"\n\n\n"
            + CHOOSE.format(body=(
                "    cands = [(step_seconds(model, cluster, l, z, 'none')['step'], l, z)\n"
                "             for l in planner.enumerate_layouts(model, cluster.world_size, (1, 2, 4, 8)) for z in (0, 1, 2, 3)\n"
                "             if memory_per_gpu(model, l, z, 'full') <= 0.9 * cluster.memory]\n"
                "    t, l, z = min(cands, key=lambda c: c[0])\n"
                "    return l, z, Chameleon()")))},
        "zero": ["choose_layout"],
    },
    # ---- exercise 5: run it small
    {
        "name": "returns the prediction of traffic_per_gpu instead of a measurement",
        "cells": {"ex-measure": MEASURE_HEAD.format(body=(
            "    stage = mesh_stage = (rank // tp) % pp\n"
            "    pred = traffic_per_gpu(tiny, planner.Layout(dp, tp, pp, 16 // dp // m, m), stage, bytes_per_value=8)\n"
            "    return {'stage': stage, **{a: int(round(pred[a])) for a in ('tp', 'pp', 'dp')}}"))
            + "\nsmall, z_small, r_small = choose_layout(tiny, virtual)\nmeasured = cluster4.run(metered_step, small.dp, small.pp, small.tp, small.m)\n"},
        "zero": ["metered_step"],
    },
    {
        "name": "counts the bytes received as well as sent",
        "cells": {"ex-measure": MEASURE_HEAD.format(body=METER.format(n_micro="m", count="meter.sent[a] + meter.recv[a]"))
                  + "\nsmall, z_small, r_small = choose_layout(tiny, virtual)\nmeasured = cluster4.run(metered_step, small.dp, small.pp, small.tp, small.m)\n"},
        "zero": ["metered_step"],
    },
    {
        "name": "counts the tied embedding's bytes as data-parallel traffic",
        "cells": {"ex-measure": MEASURE_HEAD.format(body=METER.format(
            n_micro="m", count="meter.sent[a] + (meter.sent['tied'] if a == 'dp' else 0)"))
                  + "\nsmall, z_small, r_small = choose_layout(tiny, virtual)\nmeasured = cluster4.run(metered_step, small.dp, small.pp, small.tp, small.m)\n"},
        "zero": ["metered_step"],
    },
    # ---- exercise 6: the bill
    {
        "name": "counts 2ND (the forward pass only)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="2 * n_params * tokens", rate="peak_flops * mfu")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "forgets the MFU (assumes the GPUs run at peak)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="6 * n_params * tokens", rate="peak_flops")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "forgets the PUE (counts the GPUs' power only)",
        "cells": {"ex2-code": COST.format(body=HOURS.format(flops="6 * n_params * tokens", rate="peak_flops * mfu")
                                          + BILL.format(pue=""))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "calls course_lib.estimate.training_cost (switched off during the check)",
        "cells": {"ex2-code": COST.format(body=(
            "    return E.training_cost(E.training_flops(n_params, tokens), peak_flops=peak_flops, mfu=mfu,\n"
            "                           gpu_hour_price=gpu_hour_price, gpu_power_watts=gpu_power_watts, pue=pue)"))},
        "zero": ["cost_estimate"],
    },
    {
        "name": "course_lib.scaling.compute_budget's GPU-hours (not in course_lib.estimate)",
        "cells": {"ex2-code": COST.format(body=(
            "    from course_lib.scaling import compute_budget\n"
            "    gpu_hours = compute_budget(n_params, tokens, peak_flops, mfu)['gpu_hours']\n")
                                          + BILL.format(pue=" * pue"))},
        "zero": ["cost_estimate"],
    },
]
