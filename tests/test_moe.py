"""Mixture of experts (course_lib.moe and the JAX section of course_lib.jax_spmd).

The router, the dispatch order, capacity and the auxiliary losses need no processes; expert
parallelism runs on one warm 4-rank cluster (2 and 4 ranks) and must equal the one-process layer on
the concatenated tokens, outputs and gradients, with the all-to-all bytes equal to the formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from course_lib import moe as X
from course_lib.launch import Cluster, RankError


def _reference(layer, tokens):
    """Token by token: sum over the token's kept choices of weight * expert(token)."""
    r = X.route(tokens, layer.gate.weight, layer.top_k, normalize=layer.normalize)
    pos = X.dispatch_positions(r.experts, layer.n_experts, layer.capacity(tokens.shape[0]))
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(layer.top_k):
            if pos[t, j] >= 0:
                out[t] += r.weights[t, j] * layer.experts[int(r.experts[t, j])](tokens[t])
    return out


@pytest.mark.parametrize("k, cf, normalize", [(1, None, False), (2, None, True), (2, 0.5, True), (3, 1.0, False)])
def test_moe_layer_equals_the_token_by_token_definition(k, cf, normalize):
    torch.manual_seed(0)
    layer = X.MoELayer(8, 16, 4, k, capacity_factor=cf, normalize=normalize).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    y = layer(x)
    assert torch.allclose(y.reshape(-1, 8), _reference(layer, x.reshape(-1, 8)), atol=1e-12)
    if cf is None:
        assert layer.last["dropped"] == 0.0
    assert int(layer.last["counts"].sum()) == 18 * k


def test_route_top_k_and_normalisation():
    torch.manual_seed(1)
    x, w = torch.randn(20, 6), torch.randn(5, 6)
    r = X.route(x, w, 2)
    assert torch.allclose(r.probs.sum(-1), torch.ones(20))
    assert torch.equal(r.experts, r.probs.topk(2, dim=-1).indices)
    assert torch.allclose(r.weights.sum(-1), torch.ones(20))
    # renormalised top-k probabilities are a softmax over the chosen logits
    chosen = r.logits.gather(1, r.experts)
    assert torch.allclose(r.weights, chosen.softmax(-1), atol=1e-6)
    raw = X.route(x, w, 2, normalize=False)
    assert torch.allclose(raw.weights, r.probs.gather(1, r.experts))
    noisy = X.route(x, w, 2, noise_std=5.0, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(noisy.experts, r.experts)


def test_the_router_runs_in_fp32_for_bf16_tokens_and_weights():
    bf16 = torch.bfloat16
    # logits 1 + c 2^-12, c = 0..3 (first token) and 1 - c 2^-12 (second): exact in fp32, all 1.0 in bf16
    # (bf16's ulp at 1.0 is 2^-7); a bf16 router sees four ties in both tokens and gives both the same
    # experts, so it must be wrong for one of them: the best two are (3, 2) and (0, 1)
    w = torch.tensor([[1.0, c] for c in (0.0, 1.0, 2.0, 3.0)], dtype=bf16)
    x = torch.tensor([[1.0, 2.0 ** -12], [1.0, -2.0 ** -12]], dtype=bf16)
    r = X.route(x, w, 2)
    assert r.experts.tolist() == [[3, 2], [0, 1]]
    assert r.logits.dtype == r.probs.dtype == r.weights.dtype == torch.float32
    assert r.weights[0, 0] > r.weights[0, 1] and r.weights[1, 0] > r.weights[1, 1]
    # random bf16 tokens and router: the same decision, logits and weights, bit for bit, as the fp32
    # router on the same values; the gradient reaches the bf16 router weight as the fp32 one, rounded
    torch.manual_seed(0)
    xb, wb = torch.randn(512, 32).to(bf16), (0.02 * torch.randn(16, 32)).to(bf16).requires_grad_(True)
    w32 = wb.detach().float().requires_grad_(True)
    value = torch.randn(16)
    out = []
    for xi, wi in ((xb, wb), (xb.float(), w32)):
        ri = X.route(xi, wi, 2)
        loss = (ri.weights * value[ri.experts]).sum() + X.load_balancing_loss(ri) + X.router_z_loss(ri)
        loss.backward()
        out.append((ri, loss))
    (rb, lb), (rf, lf) = out
    assert torch.equal(rb.experts, rf.experts) and torch.equal(rb.weights, rf.weights)
    assert torch.equal(rb.logits, rf.logits) and lb.dtype == torch.float32 and torch.equal(lb, lf)
    assert wb.grad.dtype == bf16 and wb.grad.abs().sum() > 0 and torch.equal(wb.grad, w32.grad.to(bf16))


def test_a_bf16_layer_routes_and_combines_in_fp32_and_returns_bf16():
    torch.manual_seed(0)
    layer = X.MoELayer(8, 16, 4, 2).to(torch.bfloat16)
    x = torch.randn(3, 5, 8).to(torch.bfloat16).requires_grad_(True)
    y = layer(x)
    r = layer.last["routing"]
    assert y.dtype == torch.bfloat16 and r.weights.dtype == torch.float32
    assert layer.last["lb_loss"].dtype == layer.last["z_loss"].dtype == torch.float32
    ref = X.route(x.detach().reshape(-1, 8), layer.gate.weight, 2)        # the same choices
    assert torch.equal(r.experts, ref.experts)
    # the combine: bf16 expert outputs times fp32 weights, a token's k = 2 terms summed in fp32, one rounding
    tokens = x.detach().reshape(-1, 8)
    want = torch.stack([sum(r.weights[t, j] * layer.experts[int(r.experts[t, j])](tokens[t]).float()
                            for j in range(2)) for t in range(15)]).to(torch.bfloat16)
    assert torch.equal(y.detach().reshape(-1, 8), want)
    (y.float().square().mean() + layer.aux_loss(0.01, 1e-3)).backward()
    g = layer.gate.weight.grad
    assert g.dtype == torch.bfloat16 and g.abs().sum() > 0 and x.grad.dtype == torch.bfloat16


def test_dispatch_is_first_come_first_served_first_choices_first():
    pos = X.dispatch_positions(torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]]), 3, 2)
    assert pos.tolist() == [[0, 1], [1, 0], [-1, -1], [0, -1]]
    assert X.expert_capacity(16, 4, 2, 1.0) == 8 and X.expert_capacity(15, 4, 2, 0.5) == 4


def test_load_balancing_loss_is_alpha_when_uniform_and_alpha_E_when_collapsed():
    E, T = 4, 8
    uniform = X.Routing(torch.zeros(T, E), torch.full((T, E), 1 / E), torch.arange(T)[:, None] % E,
                        torch.ones(T, 1))
    assert float(X.load_balancing_loss(uniform, alpha=0.01)) == pytest.approx(0.01)
    collapsed = X.Routing(torch.zeros(T, E), torch.eye(E)[torch.zeros(T, dtype=torch.long)],
                          torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1))
    assert float(X.load_balancing_loss(collapsed, alpha=0.01)) == pytest.approx(0.01 * E)
    # its gradient lowers the probability of the overloaded expert (descent moves against the gradient)
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]] * T, requires_grad=True)
    X.load_balancing_loss(X.Routing(logits, logits.softmax(-1), torch.zeros(T, 1, dtype=torch.long),
                                    torch.ones(T, 1))).backward()
    assert (logits.grad[:, 0] > 0).all() and (logits.grad[:, 1:] < 0).all()
    z = X.router_z_loss(X.Routing(torch.full((2, 4), 3.0), None, None, None), beta=1.0)
    assert float(z) == pytest.approx((3 + math.log(4)) ** 2)


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="top_k=5 but only 4 experts"):
        X.MoELayer(8, 16, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        X.expert_capacity(8, 4, 2, 0)
    with pytest.raises(ValueError, match=r"route expects tokens \(T, h\)"):
        X.route(torch.randn(2, 3, 4), torch.randn(4, 4), 1)


def test_mixtral_8x7b_counts():
    c = X.mixtral_parameters(**X.MIXTRAL_8X7B)
    assert c["total"] == 46_702_792_704 and c["active"] == 12_879_925_248   # "46.7B" and "12.9B"


def test_moe_gpt_trains_and_reports_its_experts():
    torch.manual_seed(0)
    model = X.moe_gpt(4, 2, n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    idx = torch.randint(0, 64, (4, 16))
    logits = model(idx)
    assert logits.shape == (4, 16, 64) and len(model.moe_layers()) == 2
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    (loss + sum(l.aux_loss(0.01) for l in model.moe_layers())).backward()
    assert model.moe_layers()[0].gate.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- expert parallelism
def _ep_case(rank, world_size, n, builtin, cf):
    import torch.distributed as dist
    from course_lib.mesh import CommMeter
    group = None if n == world_size else dist.new_group(list(range(n)))
    if rank >= n:
        return None
    torch.manual_seed(0)
    full = X.MoELayer(8, 16, 4, 2, capacity_factor=cf).double()
    xs = torch.randn(n, 6, 8, dtype=torch.float64)                # every rank's tokens, known to all
    dy = torch.randn(n, 6, 8, dtype=torch.float64)
    ep = X.ExpertParallelMoE.from_moe(full, group, builtin=builtin)
    x = xs[rank].clone().requires_grad_(True)
    with CommMeter({"ep": group}) as meter:
        y = ep(x)
        (y * dy[rank]).sum().backward()
    ep.sync_grads()
    xa = xs.reshape(-1, 8).clone().requires_grad_(True)
    ya = full(xa)
    (ya * dy.reshape(-1, 8)).sum().backward()
    out_err = float((y - ya.view(n, 6, 8)[rank]).detach().abs().max())
    dx_err = float((x.grad - xa.grad.view(n, 6, 8)[rank]).abs().max())
    experts = [full.experts[ep.first + i] for i in range(ep.local)]
    # data parallelism's convention: every gradient is the one-process gradient of all n ranks' losses / n
    w_err = max(float((p.grad - q.grad / n).abs().max()) for mine, ref in zip(ep.experts, experts)
                for p, q in zip(mine.parameters(), ref.parameters()))
    gate_err = float((ep.gate.weight.grad - full.gate.weight.grad / n).abs().max())
    return dict(out=out_err, dx=dx_err, w=w_err, gate=gate_err, sent=sum(meter.sent.values()),
                capacity=ep.last["capacity"], local=ep.local)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, timeout=120) as c:
        yield c


@pytest.mark.parametrize("n, builtin", [(2, False), (4, False), (4, True)])
def test_expert_parallel_equals_one_process(cluster, n, builtin):
    res = [r for r in cluster.run(_ep_case, n, builtin, None) if r is not None]
    assert len(res) == n
    for r in res:
        assert r["out"] < 1e-12 and r["dx"] < 1e-12 and r["w"] < 1e-12
        # router and experts on one convention: the one-process gradient of the n ranks' losses / n
        assert r["gate"] < 1e-12
        if not builtin:
            assert r["sent"] == 2 * 2 * X.all_to_all_bytes(n, r["local"], r["capacity"], 8, 8)


def _bad_split(rank, world_size):
    X.ExpertParallelMoE(8, 16, 6, 2)


def test_experts_must_split_over_the_ranks(cluster):
    with pytest.raises(RankError, match="6 experts do not split over 4 ranks"):
        cluster.run(_bad_split)


# --------------------------------------------------------------------------- global-batch load balancing
def _balance_case(rank, world_size, ranks):
    import torch.distributed as dist
    group = dist.new_group(ranks)                        # every rank creates it, members use it
    if rank not in ranks:
        return None
    E, k, h, T = 4, 2, 8, 6
    torch.manual_seed(0)
    w = torch.randn(E, h, dtype=torch.float64)
    xs = torch.randn(world_size, T, h, dtype=torch.float64) + 2.0 * w[torch.arange(world_size) % E, None]
    mine = xs[rank]                                      # rank r's tokens lean to expert r: f differs by rank
    gw = w.clone().requires_grad_(True)
    r = X.route(mine, gw, k)
    loss_global = X.load_balancing_loss(r, 0.5, group)
    loss_local = X.load_balancing_loss(r, 0.5)
    loss_global.backward()
    g = gw.grad.clone()
    dist.all_reduce(g, group=group)                      # data parallelism's mean of the gradients
    g /= len(ranks)
    # one process: f over the concatenation of the group's tokens, P this rank's
    every = X.route(xs[ranks].reshape(-1, h), w, k)
    f_all = X.tokens_per_expert(every.experts, E).double() / every.experts.numel()
    f_mine = X.tokens_per_expert(r.experts, E).double() / r.experts.numel()
    P = r.probs.detach().mean(0)
    # and the gradient of the global-batch loss (f and P over the concatenation) in one process
    w1 = w.clone().requires_grad_(True)
    X.load_balancing_loss(X.route(xs[ranks].reshape(-1, h), w1, k), 0.5).backward()
    layer = X.MoELayer(h, 16, E, k, balance_group=group).double()
    with torch.no_grad():
        layer.gate.weight.copy_(w)
    layer(mine)
    # ranks with different numbers of tokens (2, 3, 4, 5): f is the concatenation's, not the mean of the f's
    sizes = [2 + i for i in range(world_size)]
    uneven = [X.route(xs[i, :sizes[i]], w, k) for i in range(world_size)]
    ru = uneven[rank]
    f_cat = X.tokens_per_expert(torch.cat([uneven[i].experts for i in ranks]), E).double() / (k * sum(
        sizes[i] for i in ranks))
    return dict(uneven=float(X.load_balancing_loss(ru, 1.0, group)),
                want_uneven=float(E * (f_cat * ru.probs.mean(0)).sum()),counts=X.tokens_per_expert(r.experts, E, group).tolist(),
                counts_all=X.tokens_per_expert(every.experts, E).tolist(),
                glob=float(loss_global), want_glob=float(0.5 * E * (f_all * P).sum()),
                local=float(loss_local), want_local=float(0.5 * E * (f_mine * P).sum()),
                layer=float(layer.last["lb_loss"]), want_layer=float(E * (f_all * P).sum()),
                grad_err=float((g - w1.grad).abs().max()))


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [1, 3]])
def test_global_batch_statistic_counts_the_tokens_of_every_rank_of_the_group(cluster, ranks):
    res = cluster.run(_balance_case, ranks)
    assert [i for i, r in enumerate(res) if r is not None] == ranks
    for r in (r for r in res if r is not None):
        assert r["counts"] == r["counts_all"]            # the all-reduced counts: every rank's tokens
        assert r["glob"] == pytest.approx(r["want_glob"], rel=1e-12)
        assert r["local"] == pytest.approx(r["want_local"], rel=1e-12)
        assert abs(r["glob"] - r["local"]) > 1e-3      # the two statistics differ here
        assert r["layer"] == pytest.approx(r["want_layer"], rel=1e-12)
        assert r["uneven"] == pytest.approx(r["want_uneven"], rel=1e-12)
        # averaged over the ranks, the local gradients are the global-batch loss's (equal token counts)
        assert r["grad_err"] < 1e-12


# --------------------------------------------------------------------------- JAX
def test_jax_moe_layer_and_expert_parallel_version_agree_with_torch():
    import subprocess
    import sys
    code = r'''
from course_lib.launch import jax_cpu_devices
devs = jax_cpu_devices(4)
import jax, jax.numpy as jnp, numpy as np, torch
from jax.sharding import Mesh
from course_lib import jax_spmd as J, moe as X
T, d, f, E = 16, 8, 12, 4
rng = np.random.default_rng(0)
W1, b1 = rng.normal(size=(E, d, f)) * .3, rng.normal(size=(E, f)) * .3
W2, b2 = rng.normal(size=(E, f, d)) * .3, rng.normal(size=(E, d)) * .3
gate, x = rng.normal(size=(d, E)), rng.normal(size=(T, d))
ref, probs = J.moe_layer(x, gate, [(W1[e], b1[e], W2[e], b2[e]) for e in range(E)], 2)
ep = J.expert_parallel_moe(x, gate, W1, b1, W2, b2, Mesh(np.array(devs), ("x",)), "x", 2)
layer = X.MoELayer(d, f, E, 2, activation="relu").double()
with torch.no_grad():
    layer.gate.weight.copy_(torch.tensor(gate.T))
    for e, ex in enumerate(layer.experts):
        ex.fc1.weight.copy_(torch.tensor(W1[e].T)); ex.fc1.bias.copy_(torch.tensor(b1[e]))
        ex.fc2.weight.copy_(torch.tensor(W2[e].T)); ex.fc2.bias.copy_(torch.tensor(b2[e]))
    t = layer(torch.tensor(x)).numpy()
print(float(np.abs(np.asarray(ref) - t).max()), float(np.abs(np.asarray(ep) - np.asarray(ref)).max()))
'''
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    torch_err, ep_err = map(float, out.stdout.split())
    assert torch_err < 1e-5 and ep_err < 1e-5


@pytest.mark.parametrize("seed, T, E, k, cap, skew", [(0, 64, 8, 2, 4, 3.0), (1, 50, 4, 1, 20, 0.0), (2, 33, 6, 3, 5, 5.0)])
def test_dispatch_never_exceeds_capacity_and_drops_nothing_when_there_is_room(seed, T, E, k, cap, skew):
    g = torch.Generator().manual_seed(seed)
    experts = (torch.randn(T, E, generator=g) + skew * torch.linspace(0, 1, E)).topk(k, dim=-1).indices
    assert all(len(set(row.tolist())) == k for row in experts)              # k distinct experts per token
    pos = X.dispatch_positions(experts, E, cap)
    kept = pos >= 0
    load = torch.bincount(experts[kept], minlength=E)
    assert int(load.max()) <= cap
    for e in range(E):                                                       # slots 0 .. load-1, each once
        assert sorted(pos[kept & (experts == e)].tolist()) == list(range(int(load[e])))
    roomy = X.dispatch_positions(experts, E, T)
    assert bool((roomy >= 0).all())


# --------------------------------------------------------------------------- 2025's MoE: bias balancing, dropless, shared experts
def test_the_balancing_bias_changes_the_choice_but_not_the_weights_or_their_gradient():
    torch.manual_seed(2)
    x, w = torch.randn(40, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4, 0.1], dtype=torch.float64, requires_grad=True)
    g1 = w.clone().requires_grad_(True)
    r = X.route(x, g1, 2, bias=bias)
    probs = (x @ w.t()).softmax(-1)
    assert torch.equal(r.experts, (probs + bias.detach()).topk(2, dim=-1).indices)
    assert not torch.equal(r.experts, probs.topk(2, dim=-1).indices)          # the bias did change choices
    chosen = probs.gather(1, r.experts)
    assert torch.allclose(r.weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-12)   # unbiased weights
    R = torch.randn(40, 2, dtype=torch.float64)
    (r.weights * R).sum().backward()
    assert bias.grad is None                                                  # the bias gets no gradient
    g2 = w.clone().requires_grad_(True)                                       # same choice, no bias in sight
    p2 = (x @ g2.t()).softmax(-1).gather(1, r.experts)
    ((p2 / p2.sum(-1, keepdim=True)) * R).sum().backward()
    assert torch.allclose(g1.grad, g2.grad, atol=1e-12)


def test_bias_update_moves_by_the_sign_of_the_imbalance_and_balances_a_skewed_router():
    bias = torch.zeros(4)
    X.update_expert_bias(bias, torch.tensor([10, 2, 4, 0]), 0.1)              # mean 4
    assert torch.allclose(bias, torch.tensor([-0.1, 0.1, 0.0, 0.1]))
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    w[:, 0] += torch.linspace(0, 3.0, 8)                                      # skewed: the last experts win
    busiest = {}
    for rate in (0.0, 0.003):
        g, bias, busiest[rate] = torch.Generator().manual_seed(1), torch.zeros(8), []
        for _ in range(60):                                                   # fresh tokens every step
            x = torch.randn(256, 16, generator=g)
            x[:, 0] = 1.0
            counts = X.tokens_per_expert(X.route(x, w, 2, bias=bias).experts, 8)
            busiest[rate].append(int(counts.max()))
            X.update_expert_bias(bias, counts, rate)
    late = {rate: sum(b[-20:]) / 20 for rate, b in busiest.items()}          # even: 2 * 256 / 8 = 64
    assert late[0.0] > 100 and late[0.003] < 0.85 * late[0.0], late
    assert X.MoELayer(16, 16, 8, 2).to(torch.bfloat16).expert_bias.dtype == torch.float32   # small steps survive
    layer = X.MoELayer(16, 16, 8, 2)                                          # the layer's own bias and update
    layer(x)
    counts = layer.last["counts"].float()
    assert torch.equal(layer.update_bias(0.5), 0.5 * torch.sign(counts.mean() - counts))
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        X.update_expert_bias(torch.zeros(8), torch.zeros(4), 0.1)


def test_node_limited_routing_keeps_each_token_on_at_most_m_nodes():
    torch.manual_seed(3)
    x, w = torch.randn(200, 8), torch.randn(16, 8)
    free = X.route(x, w, 4)
    limited = X.route(x, w, 4, n_nodes=4, max_nodes=2)
    nodes = limited.experts // 4                                              # 4 experts per node
    assert max(len(set(row)) for row in nodes.tolist()) <= 2
    assert max(len(set(row)) for row in (free.experts // 4).tolist()) > 2    # unlimited does use more
    assert torch.equal(X.route(x, w, 4, n_nodes=4, max_nodes=4).experts, free.experts)
    # the nodes are those with the largest sum of their k / M = 2 best scores
    node_score = free.probs.view(200, 4, 4).topk(2, dim=-1).values.sum(-1)
    best = node_score.topk(2, dim=-1).indices.sort(-1).values
    for t in range(200):
        assert set(nodes[t].tolist()) <= set(best[t].tolist())
    with pytest.raises(ValueError, match="max_nodes"):
        X.route(x, w, 6, n_nodes=4, max_nodes=1)
    # the inter-node hop sends each token once per other node it uses: at most M - 1 or M of them
    for lim, most in ((limited, 2), (free, 3)):
        rows = X.node_dispatch_rows(lim.experts, 2, 2, 0, 8)                   # 8 ranks = 4 nodes of 2
        assert rows[0] == rows[1] == 0 and sum(rows[1::2]) == 0                 # only local index 0, other nodes
        assert sum(rows) == sum(len({n for n in set(r) if n != 0}) for r in (lim.experts // 4).tolist())
        assert max(len({n for n in set(r) if n != 0}) for r in (lim.experts // 4).tolist()) <= most


def test_grouped_linear_equals_a_loop_forward_and_backward():
    torch.manual_seed(4)
    counts = torch.tensor([3, 0, 5, 4])
    x = torch.randn(12, 8, requires_grad=True)
    wt, b = torch.randn(4, 16, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    R = torch.randn(12, 16)
    got = {}
    for grouped in ([False, True] if X.grouped_mm_available() else [False]):
        for t in (x, wt, b):
            t.grad = None
        (X.grouped_linear(x, wt, b, counts, use_grouped_mm=grouped) * R).sum().backward()
        got[grouped] = [t.grad.clone() for t in (x, wt, b)]
    want = torch.cat([x[s:e] @ wt[g].t() + b[g] for g, (s, e) in enumerate([(0, 3), (3, 3), (3, 8), (8, 12)])])
    assert torch.allclose(X.grouped_linear(x, wt, b, counts), want, atol=1e-5)
    for grads in got.values():
        assert all(torch.allclose(a, c, atol=1e-4) for a, c in zip(grads, got[False]))


def _dropless_case(rank, world_size, n, builtin, dtype):
    import torch.distributed as dist
    from course_lib.mesh import CommMeter
    group = dist.new_group(list(range(n)))
    if rank >= n:
        return None
    torch.manual_seed(0)
    full = X.MoELayer(8, 16, 8, 3).to(dtype)
    full.expert_bias.copy_(torch.randn(8) * 0.2)                              # a balancing bias, copied to the ranks
    T = [5, 9, 2, 7][:n]                                                       # uneven tokens per rank
    xs = [torch.randn(t, 8, dtype=dtype) * 2 for t in T]
    dys = [torch.randn(t, 8, dtype=dtype) for t in T]
    ep = X.DroplessMoE.from_moe(full, group, builtin=builtin)
    x = xs[rank].clone().requires_grad_(True)
    with CommMeter({"ep": group}) as meter:
        y = ep(x)
    (y * dys[rank]).sum().backward()
    ep.sync_grads()
    xa = torch.cat(xs).requires_grad_(True)
    ya = full(xa)
    (ya * torch.cat(dys)).sum().backward()
    lo = sum(T[:rank])
    mine = [full.experts[ep.first + i] for i in range(ep.local)]
    tol = lambda a, b: float((a - b).abs().max())
    return dict(out=tol(y, ya[lo:lo + T[rank]]), dx=tol(x.grad, xa.grad[lo:lo + T[rank]]),
                w=max(tol(p.grad * n, q.grad) for a, b in zip(ep.experts, mine)
                      for p, q in zip(a.parameters(), b.parameters())),
                gate=tol(ep.gate.weight.grad * n, full.gate.weight.grad), sent=meter.sent["ep"],
                want_sent=(X.dropless_bytes(ep.last["sent_rows"], rank, 8, x.element_size())      # dispatch
                           + X.dropless_bytes(ep.last["recv_rows"], rank, 8, x.element_size())    # combine
                           + 8 * (n - 1) * ep.local),                                             # counts

                rows=sum(ep.last["sent_rows"]), k_T=3 * T[rank])


@pytest.mark.parametrize("n, builtin, dtype", [(2, False, torch.float64), (4, False, torch.float32),
                                               (4, True, torch.float32)])
def test_dropless_expert_parallel_equals_the_capacity_free_layer(cluster, n, builtin, dtype):
    res = [r for r in cluster.run(_dropless_case, n, builtin, dtype) if r is not None]
    assert len(res) == n
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for r in res:
        assert r["out"] < tol and r["dx"] < tol and r["w"] < tol and r["gate"] < tol, r
        assert r["rows"] == r["k_T"]                                           # every choice sent, no padding
        if not builtin:                                                        # pairwise: bytes on the wire
            assert r["sent"] == r["want_sent"]


def test_shared_experts_and_fine_grained_experts_at_the_same_active_flops():
    from course_lib import estimate as E
    torch.manual_seed(5)
    layer = X.MoELayer(8, 16, 4, 2, n_shared=1).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    routed_only = X.MoELayer(8, 16, 4, 2).double()
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared")})
    assert torch.allclose(layer(x), routed_only(x) + layer.shared[0](x), atol=1e-12)
    h, T = 8, 8
    tokens = torch.randn(T, h)
    coarse = X.MoELayer(h, 4 * h, 8, 2)                    # 8 experts of 4h, top-2
    fine = X.MoELayer(h, h, 32, 7, n_shared=1)              # 32 of h, top-7, + 1 shared of h: 8 h active
    fl = [E.count_flops(m, tokens)[1] / T for m in (coarse, fine)]
    router = [2 * h * 8, 2 * h * 32]
    assert fl[0] - router[0] == fl[1] - router[1]           # the experts' FLOPs per token are equal


def test_deepseek_v3_counts():
    c = X.deepseek_parameters(**X.DEEPSEEK_V3)
    assert round(c["total"] / 1e9) == 671                   # the report: 671 B total
    assert 37.0 < c["active"] / 1e9 < 38.0                  # and 37 B activated per token
    assert c["moe_layers"] == 58
