"""vSkipper skipper interface (Sec. 3, 3.4, App. A): actions, row metadata, registry, start-up
validation, and RandomSkip (Sec. 4.4) determinism and realised skip ratio."""

import random

import pytest
import torch
from torch import nn

from impl.vskipper import (
    Action,
    Phase,
    RandomSkip,
    RowMeta,
    Skipper,
    StaticDepthSkipper,
    as_run_mask,
    build_skipper,
    register_skipper,
    registered_skippers,
    request_key,
    validate_skipper,
)
from impl.vskipper.random_skip import ROW_SALT, hash_uniform, hash_uniform_py


def _meta(n_requests: int, n_tokens: int, start: int = 0) -> RowMeta:
    return RowMeta.concat(
        [RowMeta.for_sequence(f"r{i}", start, n_tokens, prompt_len=start + n_tokens // 2) for i in range(n_requests)]
    )


# -- interface basics -----------------------------------------------------------------------------------
def test_actions_and_row_meta():
    assert int(Action.RUN) == 1 and int(Action.PROJECT_ONLY) == 0
    m = RowMeta.for_sequence("req_0", 5, 4, prompt_len=7)
    assert m.token_idx.tolist() == [5, 6, 7, 8]
    assert m.phase.tolist() == [Phase.PREFILL, Phase.PREFILL, Phase.DECODE, Phase.DECODE]
    assert m.request_keys.tolist() == [request_key("req_0")] * 4
    assert request_key("req_0") == request_key("req_0") != request_key("req_1")
    both = RowMeta.concat([m, RowMeta.for_sequence("b", 0, 2, prompt_len=9, routed=False)])
    assert len(both) == 6 and both.routed_mask.tolist() == [True] * 4 + [False] * 2
    sel = both.select(torch.tensor([1, 4]))
    assert sel.request_ids == ("req_0", "b") and sel.token_idx.tolist() == [6, 0]
    padded = m.pad_to(6)
    assert padded.is_padding.tolist() == [False] * 4 + [True] * 2
    assert padded.routed_mask.tolist() == [True] * 4 + [False] * 2
    with pytest.raises(ValueError, match="shape"):
        RowMeta(("a", "b"), torch.tensor([0]), torch.tensor([0, 0]))


def test_as_run_mask_accepts_bool_and_actions():
    assert as_run_mask(torch.tensor([True, False]), 2).tolist() == [True, False]
    ints = torch.tensor([int(Action.RUN), int(Action.PROJECT_ONLY), 1])
    assert as_run_mask(ints, 3).tolist() == [True, False, True]


def test_static_depth_plugin_example():
    sk = StaticDepthSkipper(routed_layers=[6, 4, 5, 7], n_run=2)
    assert sk.routed_layers == (4, 5, 6, 7)
    validate_skipper(sk, num_layers=8)
    h = torch.zeros(3, 16)
    meta = _meta(1, 3)
    assert [bool(sk.route(layer, h, meta).all()) for layer in sk.routed_layers] == [True, True, False, False]
    assert [bool(sk.route(layer, h, meta).any()) for layer in sk.routed_layers] == [True, True, False, False]
    assert torch.equal(sk.project(6, h, meta), h)  # no projector: identity
    with pytest.raises(ValueError, match="n_run"):
        StaticDepthSkipper(routed_layers=[1, 2], n_run=3)


def test_registry():
    assert {"random", "static-depth"} <= set(registered_skippers())
    sk = build_skipper("random", routed_layers=range(2, 6), r=0.5, d=0.5, seed=1)
    assert isinstance(sk, RandomSkip) and sk.k == 2
    assert isinstance(build_skipper("static-depth", routed_layers=[1], n_run=1), StaticDepthSkipper)
    with pytest.raises(ValueError, match="unknown skipper 'nope'.*random"):
        build_skipper("nope")

    @register_skipper("test-every-other")
    class EveryOther(Skipper):
        def route(self, layer_idx, hidden, meta):
            return (meta.token_idx + layer_idx) % 2 == 0

    sk = build_skipper("test-every-other", routed_layers=[0, 1])
    validate_skipper(sk, num_layers=2)

    with pytest.raises(ValueError, match="already registered"):
        @register_skipper("test-every-other")
        class Other(Skipper):
            pass


# -- start-up validation (e) ----------------------------------------------------------------------------
class _Returns(Skipper):
    def __init__(self, fn, routed_layers=(1, 2)):
        super().__init__(routed_layers)
        self.fn = fn

    def route(self, layer_idx, hidden, meta):
        return self.fn(hidden, meta)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda h, m: torch.ones(h.shape[0]), "float32.*bool"),  # float actions
        (lambda h, m: torch.full((h.shape[0],), 2), r"\[2\] outside the whole-layer set"),  # int action 2
        (lambda h, m: torch.tensor([0, 1, -1, 1, 0, 0, 1, 1]), r"\[-1\] outside"),
        (lambda h, m: torch.ones(h.shape[0] + 1, dtype=torch.bool), "shape"),  # wrong length
        (lambda h, m: torch.ones(h.shape[0], 1, dtype=torch.bool), "shape"),  # wrong rank
        (lambda h, m: [True] * h.shape[0], "torch.Tensor"),  # not a tensor
        (lambda h, m: torch.rand(h.shape[0]) < 0.5, "not deterministic"),  # impure
        (lambda h, m: 1 / 0, "failed on the start-up probe"),  # raises
    ],
)
def test_validate_rejects_bad_actions(fn, match):
    with pytest.raises(ValueError, match=match):
        validate_skipper(_Returns(fn), num_layers=4)


def test_validate_accepts_integer_actions():
    validate_skipper(_Returns(lambda h, m: (m.token_idx % 2).to(torch.int64)), num_layers=4)
    validate_skipper(_Returns(lambda h, m: h[:, 0] > 0), num_layers=4, hidden_size=8)


@pytest.mark.parametrize(
    "layers, match",
    [
        ((), "routes no layer"),
        ((1, 4), r"outside the model's layers \[0, 4\)"),
        ((-1, 2), "outside"),
        ((1, 1, 2), "twice"),
    ],
)
def test_validate_rejects_bad_layers(layers, match):
    with pytest.raises(ValueError, match=match):
        validate_skipper(_Returns(lambda h, m: torch.ones(h.shape[0], dtype=torch.bool), layers), num_layers=4)


def test_validate_rejects_bad_projectors():
    sk = StaticDepthSkipper(routed_layers=[1, 2], n_run=1)
    sk.set_projector(3, nn.Identity())
    with pytest.raises(ValueError, match=r"projectors at layers \[3\] outside"):
        validate_skipper(sk, num_layers=4)
    sk.set_projector(3, None)
    sk.set_projector(2, nn.Linear(16, 5))
    with pytest.raises(ValueError, match=r"project\(layer 2\) must return \[k, 16\]"):
        validate_skipper(sk, num_layers=4)
    sk.set_projector(2, nn.Linear(16, 16))
    validate_skipper(sk, num_layers=4)
    with pytest.raises(ValueError, match="subclass"):
        validate_skipper(object(), num_layers=4)


# -- RandomSkip (d) ---------------------------------------------------------------------------------------
def test_hash_matches_python_twin():
    rng = random.Random(0)
    keys = [request_key(f"q{i}") for i in range(20)] + [0, (1 << 63) - 1, -1]
    toks = [rng.randrange(0, 1 << 20) for _ in keys]
    for salt in (0, 5, 31, ROW_SALT):
        for seed in (0, 7, 123456789):
            got = hash_uniform(seed, torch.tensor(keys), torch.tensor(toks), salt)
            want = [hash_uniform_py(seed, k, t, salt) for k, t in zip(keys, toks)]
            assert got.tolist() == want
    u = hash_uniform(3, torch.tensor(keys), torch.tensor(toks), 1)
    assert bool(((u >= 0) & (u < 1)).all())


def test_random_skip_is_a_pure_function_of_request_token_layer():
    meta = _meta(6, 10)
    h = torch.randn(len(meta), 8)
    a = RandomSkip(range(1, 9), r=0.5, d=0.5, seed=11)
    b = RandomSkip(range(1, 9), r=0.5, d=0.5, seed=11)
    routes = {layer: a.route(layer, h, meta) for layer in a.routed_layers}
    for layer in a.routed_layers:
        assert torch.equal(routes[layer], b.route(layer, torch.zeros_like(h), meta))  # hidden ignored, repeatable
    # batch composition does not matter: a permuted subset of the rows gets the same actions
    perm = torch.randperm(len(meta), generator=torch.Generator().manual_seed(0))[:17]
    sub = meta.select(perm)
    for layer in a.routed_layers:
        assert torch.equal(a.route(layer, h[perm], sub), routes[layer][perm])
    c = RandomSkip(range(1, 9), r=0.5, d=0.5, seed=12)
    assert any(not torch.equal(c.route(layer, h, meta), routes[layer]) for layer in a.routed_layers)
    # each selected row skips exactly k routed layers, unselected rows none
    skips = torch.stack([~routes[layer] for layer in a.routed_layers], 1).sum(1)
    sel = a.selected(meta)
    assert skips[sel].tolist() == [a.k] * int(sel.sum()) and int(skips[~sel].sum()) == 0


@pytest.mark.parametrize(
    "r, d, choice", [(0.5, 0.5, "per_row"), (0.25, 0.75, "per_row"), (0.75, 0.25, "fixed"), (1.0, 1.0, "per_row"),
                     (0.0, 0.5, "per_row"), (0.75, 0.75, "fixed")]
)
def test_random_skip_realised_ratio(r, d, choice):
    sk = RandomSkip(range(8, 16), r=r, d=d, seed=5, layer_choice=choice)
    validate_skipper(sk, num_layers=16)
    meta = _meta(100, 60, start=3)  # 6000 rows x 8 layers
    h = torch.zeros(len(meta), 4)
    po = torch.stack([~sk.route(layer, h, meta) for layer in sk.routed_layers], 1)
    realised = po.double().mean().item()
    assert sk.skip_ratio == pytest.approx(r * d)
    assert realised == pytest.approx(r * d, abs=0.015)
    assert sk.selected(meta).double().mean().item() == pytest.approx(r, abs=0.02)
    if choice == "fixed" and 0 < sk.k < 8:
        per_layer = po.any(0)
        assert int(per_layer.sum()) == sk.k  # the same k layers for every selected row


def test_random_skip_rejects_bad_parameters():
    with pytest.raises(ValueError, match="r and d"):
        RandomSkip(range(4), r=1.5, d=0.5)
    with pytest.raises(ValueError, match="layer_choice"):
        RandomSkip(range(4), r=0.5, d=0.5, layer_choice="sometimes")


# -- the route tape (Sec. 3.1): every routed layer's route of a step at once ----------------------------
def _route_py(sk: RandomSkip, key: int, token: int, layer: int) -> bool:
    """RandomSkip's definition in pure Python (module docstring): RUN unless the row is selected and
    ``layer`` is among its k routed layers of smallest hash (ties by layer order)."""
    if not hash_uniform_py(sk.seed, key, token, ROW_SALT) < sk.r:
        return True
    if sk.layer_choice == "fixed":
        return layer not in sk._fixed_skip
    us = [(hash_uniform_py(sk.seed, key, token, x), i) for i, x in enumerate(sk.routed_layers)]
    skipped = {sk.routed_layers[i] for _, i in sorted(us)[: sk.k]}
    return layer not in skipped


@pytest.mark.parametrize("r, d, choice", [(0.5, 0.5, "per_row"), (0.75, 0.25, "per_row"), (1.0, 1.0, "per_row"),
                                          (0.5, 0.75, "fixed"), (0.0, 0.5, "per_row"), (0.5, 0.0, "per_row")])
def test_random_skip_tape_equals_per_layer_routes_and_the_python_definition(r, d, choice):
    sk = RandomSkip([3, 1, 2, 7, 5], r=r, d=d, seed=9, layer_choice=choice)
    meta = _meta(7, 9, start=2).pad_to(66)  # padding rows included
    h = torch.randn(len(meta), 4)
    tape = sk.route_tape(meta)
    assert tape.dtype == torch.bool and tuple(tape.shape) == (66, 5)
    for j, layer in enumerate(sk.routed_layers):
        assert torch.equal(tape[:, j], sk.route(layer, h, meta)), layer
    keys, toks = meta.request_keys.tolist(), meta.token_idx.tolist()
    for i in range(0, 63, 5):
        assert tape[i].tolist() == [_route_py(sk, keys[i], toks[i], x) for x in sk.routed_layers], i
    validate_skipper(sk, num_layers=8)


def test_random_skip_tape_breaks_hash_ties_by_layer_order(monkeypatch):
    sk = RandomSkip(range(4), r=1.0, d=0.5, seed=0)
    meta = _meta(1, 3)
    # equal hashes for every layer: the k lowest-ordered layers are skipped, as skips_layer's count rule says
    monkeypatch.setattr("impl.vskipper.random_skip.hash_uniform", lambda seed, keys, toks, salt: torch.zeros(
        torch.broadcast_shapes(keys.shape, toks.shape, salt.shape if isinstance(salt, torch.Tensor) else ()),
        dtype=torch.float64))
    tape = sk.route_tape(meta)
    per_layer = torch.stack([sk.route(x, torch.zeros(3, 2), meta) for x in sk.routed_layers], 1)
    assert torch.equal(tape, per_layer)
    assert tape[0].tolist() == [False, False, True, True]


def test_static_depth_tape_and_hidden_state_policies_have_none():
    sk = StaticDepthSkipper(routed_layers=[6, 4, 5, 7], n_run=3)
    tape = sk.route_tape(_meta(2, 3))
    assert tape.tolist() == [[True, True, True, False]] * 6
    assert _Returns(lambda h, m: h[:, 0] > 0).route_tape(_meta(1, 2)) is None


class _BadTape(Skipper):
    def __init__(self, tape_fn):
        super().__init__((1, 2))
        self.tape_fn = tape_fn

    def route(self, layer_idx, hidden, meta):
        return torch.ones(len(meta), dtype=torch.bool)

    def route_tape(self, meta):
        return self.tape_fn(meta)


@pytest.mark.parametrize("fn, match", [
    (lambda m: torch.ones(len(m), 2), "torch.bool"),
    (lambda m: torch.ones(len(m), 3, dtype=torch.bool), r"shape \[8, 2\]"),
    (lambda m: torch.zeros(len(m), 2, dtype=torch.bool), "disagrees with _BadTape.route"),
])
def test_validate_rejects_a_tape_that_is_not_the_routes(fn, match):
    with pytest.raises(ValueError, match=match):
        validate_skipper(_BadTape(fn), num_layers=4)
