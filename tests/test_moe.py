"""The mixture-of-experts layer (zmpi.nn.moe, docs/moe.md): a float64 reference written token by
token with the same routing (dropped tokens included), float64 finite differences through the
router's gate probabilities and the auxiliary and z losses, accumulation, every routing option,
the capacity arithmetic, routing that does not depend on how the batch is split, and one clear
error for each bad argument."""

import math
import subprocess
import sys

import numpy as np
import pytest
from gradcheck import check
from layer_contract import check_grads_accumulate, rebind_to_flat

from zmpi.nn.moe import MoE, TokenDispatcher, expert_capacity

F64 = np.float64
C, E, H = 6, 4, 5  # d_model, experts, expert hidden size


def make(dtype=F64, **options):
    """A small MoE with non-trivial parameters (biases too) and drops at capacity 1.0."""
    options = {"min_capacity": 0, "use_rts": False, **options}
    moe = MoE(C, E, hidden=H, rng=1, dtype=dtype, std=0.5, **options)
    rng = np.random.default_rng(3)
    for p in moe.parameters():
        p.data[...] = (rng.standard_normal(p.shape) * 0.5).astype(dtype)
    return moe


def tokens(shape=(2, 8, C), seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# -- the reference: every token and choice one after another, in float64 -----------------------

def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gelu(h):
    t = np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))
    dgelu = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * math.sqrt(2 / math.pi) * (
        1 + 3 * 0.044715 * h * h)
    return 0.5 * h * (1 + t), dgelu


def mlp(x, dy, W1, b1, W2, b2):
    """One expert on one token: (output, dx, [dW1, db1, dW2, db2]) for the upstream dy."""
    h = x @ W1 + b1
    a, da_dh = gelu(h)
    dh = (W2 @ dy) * da_dh
    return a @ W2 + b2, W1 @ dh, [np.outer(x, dh), dh, np.outer(a, dy), dy]


def reference_routing(moe, x, S):
    """(experts, kept) chosen by argmax and dropped in token order, every first choice before
    any second one, without the layer's code."""
    r = moe.router
    p = softmax(x @ r.weight.data.astype(F64))
    experts = np.argsort(-p, axis=1, kind="stable")[:, :r.k]
    kept = np.ones(experts.shape, bool)
    if r.drop_tokens:
        cap = max(math.ceil(r.k * S / E * r.capacity_factor), r.min_capacity)
        for g in range(x.shape[0] // S):
            taken = np.zeros(E, int)
            for j in range(r.k):
                for t in range(g * S, (g + 1) * S):
                    kept[t, j] = taken[experts[t, j]] < cap
                    taken[experts[t, j]] += 1
    return experts, kept


def reference(moe, x, dy, experts, kept, S):
    """y, dx, {parameter name: gradient}, aux_loss, z_loss of `moe` in float64 with the given
    routing, token by token, for the loss sum(y * dy) + scale * (aux_loss + z_loss)."""
    P = {name: p.data.astype(F64) for name, p in moe.named_parameters()}
    G = {name: np.zeros_like(v) for name, v in P.items()}
    r, N, k = moe.router, x.shape[0], experts.shape[1]
    scale = moe.aux_loss_scale
    logits = x @ P["router.weight"]
    p = softmax(logits)
    y, dx = np.zeros_like(x), np.zeros_like(x)
    dp = np.zeros_like(p)
    ex = ["experts." + n for n in ("fc_weight", "fc_bias", "proj_weight", "proj_bias")]
    for t in range(N):
        chosen = p[t, experts[t]]
        w = chosen if k == 1 else chosen / chosen.sum()
        c, dy_moe = None, dy[t]
        if moe.coefficient is not None:  # PR-MoE
            c = softmax(x[t] @ P["coefficient.weight"] + P["coefficient.bias"])
            dy_moe = dy[t] * c[0]
        y_moe, dw = np.zeros(C), np.zeros(k)
        for j in range(k):
            if not kept[t, j]:
                continue
            e = experts[t, j]
            out, dxe, grads = mlp(x[t], dy_moe * w[j], *(P[n][e] for n in ex))
            y_moe += w[j] * out
            dw[j] = out @ dy_moe
            dx[t] += dxe
            for n, g in zip(ex, grads, strict=True):
                G[n][e] += g
        dchosen = dw if k == 1 else (dw - (dw * w).sum()) / chosen.sum()
        dp[t, experts[t]] += dchosen
        y[t] = y_moe
        if c is not None:
            out, dxr, grads = mlp(x[t], dy[t] * c[1], *(P["residual_mlp." + n[8:]][0] for n in ex))
            y[t] = y_moe * c[0] + out * c[1]
            dc = np.array([y_moe @ dy[t], out @ dy[t]])
            dz = c * (dc - dc @ c)
            G["coefficient.weight"] += np.outer(x[t], dz)
            G["coefficient.bias"] += dz
            dx[t] += dxr + P["coefficient.weight"] @ dz
            for n, g in zip(ex, grads, strict=True):
                G["residual_mlp." + n[8:]][0] += g
        if moe.shared_experts is not None:
            out, dxs, grads = mlp(x[t], dy[t], *(P["shared_experts." + n[8:]][0] for n in ex))
            y[t] += out
            dx[t] += dxs
            for n, g in zip(ex, grads, strict=True):
                G["shared_experts." + n[8:]][0] += g
    # the losses: per group, f (the share of the choices, before drops) and P (mean probability)
    aux = 0.0
    for g in range(N // S):
        rows = slice(g * S, (g + 1) * S)
        f = np.bincount(experts[rows].ravel(), minlength=E) / (k * S)
        aux += E * (f * p[rows].mean(axis=0)).sum() / (N // S)
        dp[rows] += r.aux_loss_coef * scale * E * f / N
    lse = np.log(np.exp(logits).sum(axis=1))
    dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))
    dlogits += r.z_loss_coef * scale * 2 * lse[:, None] * p / N
    G["router.weight"] += x.T @ dlogits
    dx += dlogits @ P["router.weight"].T
    return y, dx, G, r.aux_loss_coef * aux, r.z_loss_coef * (lse ** 2).mean()


VARIANTS = {
    "top1": {},
    "top2": {"k": 2, "top2_2nd_expert_sampling": False},
    "top2_dropless": {"k": 2, "drop_tokens": False, "top2_2nd_expert_sampling": False},
    "top1_capacity_1.5": {"capacity_factor": 1.5},
    "top2_min_capacity": {"k": 2, "min_capacity": 3, "top2_2nd_expert_sampling": False},
    "residual": {"use_residual": True},
    "shared": {"k": 2, "num_shared_experts": 2, "top2_2nd_expert_sampling": False},
    "losses_scaled": {"k": 2, "z_loss_coef": 0.3, "aux_loss_coef": 0.7,
                      "top2_2nd_expert_sampling": False},
    "groups_of_4": {"k": 2, "group_size": 4, "top2_2nd_expert_sampling": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_backward_equal_the_float64_reference(variant):
    moe = make(**VARIANTS[variant])
    moe.aux_loss_scale = 2.5 if variant == "losses_scaled" else 1.0
    x = tokens()
    x2 = x.reshape(-1, C)
    S = moe.group_size or x.shape[1]
    y = moe.forward(x)
    experts, kept = reference_routing(moe, x2, S)
    np.testing.assert_array_equal(moe.routing.experts, experts)
    np.testing.assert_array_equal(moe.routing.kept, kept)
    if moe.router.drop_tokens and variant != "top2_min_capacity":
        assert not kept.all(), "the case should drop some tokens"
    dy = tokens(x.shape, seed=1)
    moe.zero_grad()
    dx = moe.backward(dy)
    y_ref, dx_ref, g_ref, aux, z = reference(moe, x2, dy.reshape(-1, C), experts, kept, S)
    np.testing.assert_allclose(y.reshape(-1, C), y_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dx.reshape(-1, C), dx_ref, rtol=1e-12, atol=1e-13)
    for name, p in moe.named_parameters():
        np.testing.assert_allclose(p.grad, g_ref[name], rtol=1e-11, atol=1e-13, err_msg=name)
    assert float(moe.aux_loss) == pytest.approx(aux, rel=1e-13)
    assert float(moe.z_loss) == pytest.approx(z, rel=1e-13, abs=1e-300)


def test_a_token_whose_choices_are_all_dropped_gets_zero():
    moe = make(k=1, top2_2nd_expert_sampling=False)
    y = moe.forward(tokens())
    dropped = ~moe.routing.kept.any(axis=1)
    assert dropped.any()
    assert not y.reshape(-1, C)[dropped].any()


def test_float32_equals_the_float64_reference_with_the_same_routing():
    moe32 = make(np.float32, k=2, use_residual=True, num_shared_experts=1, z_loss_coef=0.1,
                 top2_2nd_expert_sampling=False)
    x = tokens()
    y = moe32.forward(x.astype(np.float32))
    assert y.dtype == np.float32
    experts, kept = moe32.routing.experts, moe32.routing.kept  # float32's own routing
    dy = tokens(x.shape, seed=1)
    dx = moe32.backward(dy.astype(np.float32))
    y_ref, dx_ref, g_ref, _, _ = reference(moe32, x.reshape(-1, C), dy.reshape(-1, C),
                                           experts, kept, x.shape[1])
    np.testing.assert_allclose(y.reshape(-1, C), y_ref, rtol=1e-4, atol=1e-5 * abs(y_ref).max())
    np.testing.assert_allclose(dx.reshape(-1, C), dx_ref, rtol=1e-4,
                               atol=1e-5 * abs(dx_ref).max())
    for name, p in moe32.named_parameters():
        assert p.grad.dtype == np.float32
        np.testing.assert_allclose(p.grad, g_ref[name], rtol=1e-4,
                                   atol=1e-5 * abs(g_ref[name]).max(), err_msg=name)


# -- finite differences -----------------------------------------------------------------------

GRAD_VARIANTS = {
    **VARIANTS,
    "rts": {"k": 2, "use_rts": True},
    "jitter": {"noisy_gate_policy": "Jitter"},
    "rsample": {"k": 2, "noisy_gate_policy": "RSample"},
    "second_expert_sampling": {"k": 2, "top2_2nd_expert_sampling": True},
    "everything": {"k": 2, "use_rts": True, "noisy_gate_policy": "Jitter", "use_residual": True,
                   "num_shared_experts": 1, "z_loss_coef": 0.2, "group_size": 4},
}


@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_finite_differences_through_the_gates_and_the_losses(variant):
    """d/d(input, every parameter) of sum(y * dy) + aux_loss_scale * (aux_loss + z_loss): the
    router's weight gets its gradient through the gate probabilities (the combine weights) and
    the two losses. The random draws are keyed, so every forward routes the same way."""
    moe = make(**GRAD_VARIANTS[variant])
    moe.set_routing(key=(7, 1))
    moe.aux_loss_scale = 1.7
    rng = np.random.default_rng(5)
    x = tokens()
    y = moe.forward(x)
    routing = moe.routing
    dy = rng.standard_normal(y.shape)
    moe.zero_grad()
    dx = moe.backward(dy)

    def f():
        out = moe.forward(x)
        np.testing.assert_array_equal(moe.routing.kept, routing.kept)  # eps moves no choice
        return float((out * dy).sum() + moe.aux_loss_scale * (moe.aux_loss + moe.z_loss))

    check(f, x, dx, rng, "input", max_elementwise=96)  # elementwise: the input and the gates
    for name, p in moe.named_parameters():
        check(f, p.data, p.grad.copy(), rng, name, max_elementwise=96)
    moe.clear_cache()


@pytest.mark.parametrize("variant", ["top2", "residual", "everything"])
def test_two_backwards_double_the_grads(variant):
    moe = make(**GRAD_VARIANTS[variant])
    check_grads_accumulate(moe, tokens(), tokens(seed=1))


def test_backward_without_forward_raises():
    moe = make()
    with pytest.raises(RuntimeError):
        moe.backward(np.zeros((2, 5, C)))
    y = moe.forward(tokens())
    moe.backward(np.ones_like(y))
    with pytest.raises(RuntimeError):  # the cache is consumed
        moe.backward(np.ones_like(y))


# -- routing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens_, experts, k, factor, least, capacity", [
    (10, 3, 1, 1.5, 0, 5),
    (50, 1, 1, 1.1, 0, 55),  # 1.1 as written: in floats 50 * 1.1 is 55.00000000000001 -> 56
    (75, 3, 2, 1.1, 0, 55),  # in floats 150 / 3 * 1.1 -> 56
    (8, 4, 2, 1.0, 0, 4),  # k counts: GShard's 2 * S / E
    (10, 4, 1, 1.0, 0, 3),  # ceil
    (7, 2, 2, 1.25, 4, 9),  # ceil(8.75)
    (8, 4, 1, 1.0, 4, 4),  # min_capacity
    (8, 16, 1, 1.0, 3, 3),
    (1024, 64, 2, 1.0, 4, 32),
])
def test_capacity_arithmetic(tokens_, experts, k, factor, least, capacity):
    assert expert_capacity(tokens_, experts, k, factor, least) == capacity


def test_first_choices_come_before_second_ones():
    """GShard's and DeepSpeed's priority: an expert takes every first choice of its group
    before any second choice, whatever the tokens' order. Logits are set by hand: token 0
    prefers expert 0 then 1, tokens 1-3 expert 1 then 0; capacity ceil(2 * 4 / 4) = 2."""
    moe = make(k=2, top2_2nd_expert_sampling=False)
    moe.router.weight.data[...] = np.eye(C, E)
    x = np.zeros((1, 4, C))
    x[0, :, :2] = [[2, 1], [1, 2], [1, 2], [1, 2]]
    moe.forward(x)
    r = moe.routing
    np.testing.assert_array_equal(r.experts[:, :2], [[0, 1], [1, 0], [1, 0], [1, 0]])
    assert r.capacity == 2
    # expert 1: the first choices of tokens 1 and 2; token 0's second choice and token 3's
    # first are dropped. Expert 0: token 0's first choice, then token 1's second.
    np.testing.assert_array_equal(r.kept, [[True, False], [True, True], [True, False],
                                           [False, False]])


def test_the_dispatcher_orders_rows_by_expert_group_and_slot():
    """The order of a capacity buffer, which expert parallelism will send: expert-major, then
    group, then slot; each row is its token's input; counts are the kept rows per expert."""
    moe = make(k=2, group_size=4, use_rts=True)
    x2 = tokens((4, 8, C)).reshape(-1, C)
    routing = moe.router.forward(x2, 4)
    rows, perm = TokenDispatcher().dispatch(x2, routing)
    choice = perm.row_choice
    expert = routing.experts.ravel()[choice]
    group = perm.row_token // 4
    slot = routing.slot.ravel()[choice]
    assert routing.kept.ravel()[choice].all() and len(choice) == routing.kept.sum()
    key = (expert * routing.groups + group) * routing.capacity + slot
    assert (np.diff(key) > 0).all()
    np.testing.assert_array_equal(perm.counts, np.bincount(expert, minlength=E))
    np.testing.assert_array_equal(rows, x2[perm.row_token])
    np.testing.assert_array_equal(perm.row_of.ravel()[choice], np.arange(len(choice)))
    assert (perm.row_of[~routing.kept] == len(choice)).all()  # the zero row
    moe.router.clear_cache()


def test_capacity_is_counted_per_group():
    moe = make(k=2, group_size=5, top2_2nd_expert_sampling=False)
    moe.forward(tokens((4, 5, C)))
    r = moe.routing
    assert (r.groups, r.capacity) == (4, math.ceil(2 * 5 / E))
    for g in range(4):
        rows = slice(5 * g, 5 * g + 5)
        kept = np.bincount(r.experts[rows][r.kept[rows]], minlength=E)
        assert (kept <= r.capacity).all()
        assert (r.slot[rows][r.kept[rows]] < r.capacity).all()
    np.testing.assert_array_equal(r.load, np.bincount(r.experts.ravel(), minlength=E))


def test_dropless_keeps_every_token_and_sizes_capacity_by_the_busiest_expert():
    moe = make(k=2, drop_tokens=False, capacity_factor=0.5)
    moe.forward(tokens())
    r = moe.routing
    assert r.kept.all()
    per_group = [np.bincount(r.experts[8 * g:8 * g + 8].ravel(), minlength=E) for g in range(2)]
    assert r.capacity == max(c.max() for c in per_group)


def test_random_token_selection_keeps_capacity_at_random_and_reproducibly():
    x = tokens((8, 16, C))
    moe = make(k=1, use_rts=True)
    moe.forward(x)
    r = moe.routing
    order = make(k=1, use_rts=False)
    order.forward(x)
    np.testing.assert_array_equal(r.experts, order.routing.experts)  # rts changes drops only
    for g in range(8):  # every overfull expert still keeps exactly its capacity
        rows = slice(16 * g, 16 * g + 16)
        load = np.bincount(r.experts[rows].ravel(), minlength=E)
        kept = np.bincount(r.experts[rows][r.kept[rows]], minlength=E)
        np.testing.assert_array_equal(kept, np.minimum(load, r.capacity))
    assert (r.kept != order.routing.kept).any()  # not the first tokens in order
    again = make(k=1, use_rts=True)
    again.forward(x)
    np.testing.assert_array_equal(again.routing.kept, r.kept)  # same seed and key: same draw
    again.set_routing(key=(1,))
    again.forward(x)
    assert (again.routing.kept != r.kept).any()
    again.training = False  # evaluation: no draw, drops in token order
    again.forward(x)
    np.testing.assert_array_equal(again.routing.kept, order.routing.kept)


@pytest.mark.parametrize("options", [
    {"k": 2, "use_rts": True, "noisy_gate_policy": "Jitter"},
    {"k": 2, "noisy_gate_policy": "RSample"},
    {"k": 2, "top2_2nd_expert_sampling": True, "use_rts": True},
    {"k": 2, "group_size": 8, "use_rts": True, "noisy_gate_policy": "Jitter"},
])
def test_a_split_batch_routes_and_computes_as_the_whole(options):
    """What a data-parallel rank sees: half the sequences, with the global index of its first
    group. The same choices and drops, and the same outputs, as one process."""
    moe = make(**options)
    moe.set_routing(key=(3, 0))
    x = tokens((4, 8, C))
    y = moe.forward(x)
    whole = moe.routing
    groups = whole.groups // 2
    for half in range(2):
        moe.set_routing(key=(3, 0), group_offset=half * groups)
        y_half = moe.forward(x[2 * half:2 * half + 2])
        rows = slice(16 * half, 16 * half + 16)
        for field in ("experts", "kept", "slot"):
            np.testing.assert_array_equal(getattr(moe.routing, field),
                                          getattr(whole, field)[rows], err_msg=field)
        np.testing.assert_allclose(y_half, y[2 * half:2 * half + 2], rtol=1e-13, atol=1e-14)


def test_noise_and_sampling_act_while_training_only():
    x = tokens((4, 8, C))
    plain = make(k=2, top2_2nd_expert_sampling=False)
    plain.forward(x)
    for options in ({"k": 2, "noisy_gate_policy": "RSample"}, {"k": 2},  # sampling: None -> on
                    {"k": 2, "noisy_gate_policy": "Jitter", "top2_2nd_expert_sampling": False}):
        moe = make(**options)
        y = moe.forward(x)
        assert (moe.routing.experts != plain.routing.experts).any() or \
            not np.allclose(y, plain.forward(x)), options
        moe.training = False
        np.testing.assert_array_equal(moe.forward(x), plain.forward(x))
    sampled = make(k=2)  # second-expert sampling leaves the first choice alone
    sampled.forward(x)
    np.testing.assert_array_equal(sampled.routing.experts[:, 0], plain.routing.experts[:, 0])
    assert (sampled.routing.experts[:, 1] != plain.routing.experts[:, 1]).any()


def test_eval_capacity_factor_applies_in_evaluation():
    moe = make(capacity_factor=1.0, eval_capacity_factor=2.0)
    x = tokens((2, 8, C))
    moe.forward(x)
    assert moe.routing.capacity == 2
    moe.training = False
    moe.forward(x)
    assert moe.routing.capacity == 4


def test_balanced_routing_gives_the_aux_loss_its_coefficient():
    """Uniform probabilities (a zero gate): P_e = 1/E, so E * sum f_e P_e = 1 whatever f, and
    logsumexp = log E for every token."""
    moe = make(k=2, aux_loss_coef=0.25, z_loss_coef=0.5)
    moe.router.weight.data[...] = 0
    moe.forward(tokens())
    assert float(moe.aux_loss) == pytest.approx(0.25, rel=1e-14)
    assert float(moe.z_loss) == pytest.approx(0.5 * math.log(E) ** 2, rel=1e-14)


def test_parameter_names_and_counts():
    moe = make(k=2, use_residual=True, num_shared_experts=2)
    names = {n: p.shape for n, p in moe.named_parameters()}
    assert names == {
        "router.weight": (C, E),
        "experts.fc_weight": (E, C, H), "experts.fc_bias": (E, H),
        "experts.proj_weight": (E, H, C), "experts.proj_bias": (E, C),
        "residual_mlp.fc_weight": (1, C, H), "residual_mlp.fc_bias": (1, H),
        "residual_mlp.proj_weight": (1, H, C), "residual_mlp.proj_bias": (1, C),
        "coefficient.weight": (C, 2), "coefficient.bias": (2,),
        "shared_experts.fc_weight": (1, C, 2 * H), "shared_experts.fc_bias": (1, 2 * H),
        "shared_experts.proj_weight": (1, 2 * H, C), "shared_experts.proj_bias": (1, C)}


def test_parameters_are_read_at_call_time_like_the_engine_rebinds_them():
    moe = make(np.float32, k=2, use_residual=True)
    x = tokens().astype(np.float32)
    y_ref = moe.forward(x)
    moe.backward(np.ones_like(y_ref))
    g_ref = np.concatenate([p.grad.ravel() for p in moe.parameters()])
    _, flat_grad, _ = rebind_to_flat(moe)
    np.testing.assert_array_equal(moe.forward(x), y_ref)
    moe.backward(np.ones_like(y_ref))
    np.testing.assert_array_equal(flat_grad, g_ref)
    for p in moe.parameters():  # ZeRO-3 release
        p.data = None
    with pytest.raises(RuntimeError, match="released"):
        moe.forward(x)


def test_float16_storage_accumulates_in_float16():
    moe = make(np.float16, k=2)
    y = moe.forward(tokens().astype(np.float32))
    assert y.dtype == np.float32
    moe.backward(np.ones_like(y))
    assert all(p.grad.dtype == np.float16 and np.isfinite(p.grad).all()
               for p in moe.parameters())


def test_importing_the_layer_does_not_import_mpi4py():
    code = "import sys, zmpi.nn.moe; assert 'mpi4py' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- bad arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"num_experts": 0}, "num_experts must be an integer >= 1, got 0"),
    ({"num_experts": 2.0}, "num_experts must be an integer >= 1, got 2.0"),
    ({"d_model": True}, "d_model must be an integer >= 1, got True"),
    ({"k": 0}, "k must be an integer >= 1, got 0"),
    ({"k": 5}, "k=5 experts per token, but only num_experts=4"),
    ({"capacity_factor": 0}, "capacity_factor must be a finite number > 0, got 0"),
    ({"capacity_factor": float("nan")}, "capacity_factor must be a finite number > 0"),
    ({"eval_capacity_factor": -1.0}, "eval_capacity_factor must be a finite number > 0"),
    ({"capacity_factor": "1.0"}, "capacity_factor must be a finite number > 0, got '1.0'"),
    ({"min_capacity": -1}, "min_capacity must be an integer >= 0, got -1"),
    ({"drop_tokens": 1}, "drop_tokens must be True or False, got 1"),
    ({"use_rts": "yes"}, "use_rts must be True or False, got 'yes'"),
    ({"noisy_gate_policy": "jitter"}, "noisy_gate_policy 'jitter': use None, 'Jitter' or"),
    ({"top2_2nd_expert_sampling": True}, "needs k >= 2 (k=1 here)"),
    ({"top2_2nd_expert_sampling": 1.0}, "top2_2nd_expert_sampling must be True, False or None"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef must be a finite number >= 0, got -0.1"),
    ({"z_loss_coef": float("inf")}, "z_loss_coef must be a finite number >= 0, got inf"),
    ({"hidden": 0}, "hidden must be an integer >= 1, got 0"),
    ({"num_shared_experts": -1}, "num_shared_experts must be an integer >= 0, got -1"),
    ({"use_residual": "true"}, "use_residual must be True or False, got 'true'"),
    ({"group_size": 0}, "group_size must be an integer >= 1, got 0"),
    ({"seed": -3}, "seed must be an integer >= 0, got -3"),
])
def test_bad_arguments_are_one_clear_error(options, message):
    args = {"d_model": C, "num_experts": E, **options}
    with pytest.raises(ValueError) as error:
        MoE(args.pop("d_model"), args.pop("num_experts"), **args)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("shape, options, message", [
    ((2, 5, C + 1), {}, f"MoE input must be (..., tokens, {C}), got shape (2, 5, 7)"),
    ((C,), {}, f"MoE input must be (..., tokens, {C}), got shape (6,)"),
    ((2, 5, C), {"group_size": 4}, "10 tokens do not split into routing groups of "
                                   "group_size=4"),
    ((0, 5, C), {}, f"MoE input has no tokens (shape (0, 5, {C}))"),
])
def test_bad_inputs_are_one_clear_error(shape, options, message):
    moe = make(**options)
    with pytest.raises(ValueError) as error:
        moe.forward(np.zeros(shape))
    assert str(error.value) == message


@pytest.mark.parametrize("key, offset, message", [
    ((-1,), 0, "routing key[0] must be an integer >= 0, got -1"),
    ((1, 2.5), 0, "routing key[1] must be an integer >= 0, got 2.5"),
    ((1,), -2, "group_offset must be an integer >= 0, got -2"),
])
def test_bad_routing_keys_are_one_clear_error(key, offset, message):
    with pytest.raises(ValueError) as error:
        make().set_routing(key, offset)
    assert str(error.value) == message
