"""vSkipper routed execution (Sec. 3.1-3.2) on tiny random Llama and Qwen3 models, in plain PyTorch and
inside transformers' continuous-batching engine:

(a) an all-RUN skipper through the routed (cohort) path reproduces the dense model;
(b) Project-Only rows match a straightforward per-row reference (K/V written, projector applied, RUN
    rows attending to every cached K/V);
(c) concurrent requests of different lengths under RandomSkip give the same tokens in the engine as the
    plain-PyTorch routed reference per request (Invariants 1 and 2, the row side channel).
"""

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from impl.vskipper import (
    RandomSkip,
    RowMeta,
    Skipper,
    StaticDepthSkipper,
    bind_skipper,
    generate_greedy,
    plain_forward,
    plain_greedy,
    routed_cb_config,
    routed_context,
    unbind_skipper,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_LAYERS = 4
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 2, 3],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 61]]
NEW = 6


def _tiny(family: str):
    """A seeded random 4-layer model (hidden 32, 4 query / 2 KV heads: GQA), initialised wide like the
    conftest tiny_model so that skipped layers change the greedy tokens."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0,
                  initializer_range=0.2)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    model.eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def base_model(family):
    return _tiny(family)


def _cb():
    # small pages and token budget: chunked prefill, queued requests, prefill and decode rows mixed
    return routed_cb_config(page_size=16, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4)


class ParitySkip(Skipper):
    """Test policy: Project-Only iff (token + 2 * layer + request key) % 3 == 0, a projector at layer 2."""

    prefix_shareable = False

    def __init__(self, hidden_size: int):
        super().__init__(routed_layers=(1, 2, 3))
        gen = torch.Generator().manual_seed(7)
        proj = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():
            proj.weight.copy_(torch.eye(hidden_size) + 0.05 * torch.randn(hidden_size, hidden_size, generator=gen))
            proj.bias.zero_()
        self.set_projector(2, proj)

    def route(self, layer_idx, hidden, meta):
        return (meta.token_idx + 2 * layer_idx + meta.request_keys) % 3 != 0


def _reference_greedy(model, skipper, prompt, request_id, n_new):
    """Straightforward per-row reference on the UNMODIFIED model: tokens one at a time; at a routed layer
    a Project-Only row computes this layer's K/V from its input hidden state (k_norm and rotary
    included) and appends them to the cache, and its output is projector(input); a RUN row goes
    through the original layer, attending to every cached K/V (Project-Only rows' included)."""
    import sys

    layers = model.model.layers
    cache = DynamicCache(config=model.config)
    tokens, out, logits_out = list(prompt), [], []
    with torch.no_grad():
        for pos in range(len(prompt) + n_new - 1):
            h = model.model.embed_tokens(torch.tensor([[tokens[pos]]]))
            pid = torch.tensor([[pos]])
            pe = model.model.rotary_emb(h, pid)
            meta = RowMeta.for_sequence(request_id, pos, 1, prompt_len=len(prompt))
            for idx, layer in enumerate(layers):
                if idx in skipper.routed_layers and not bool(skipper.route(idx, h[0], meta)[0]):
                    attn = layer.self_attn
                    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
                    x = layer.input_layernorm(h)
                    k = attn.k_proj(x).view(1, 1, -1, attn.head_dim)
                    if hasattr(attn, "k_norm"):
                        k = attn.k_norm(k)
                    k = k.transpose(1, 2)
                    v = attn.v_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
                    k = rope(k, k, *pe)[1]
                    cache.update(k, v, idx)
                    h = skipper.project(idx, h[0], meta)[None]
                else:
                    h = layer(h, attention_mask=None, position_ids=pid, cache=cache, use_cache=True,
                              position_embeddings=pe)
            if pos >= len(prompt) - 1:
                logits = model.lm_head(model.model.norm(h))[0, -1]
                tok = int(logits.argmax())
                out.append(tok)
                logits_out.append(logits)
                tokens.append(tok)
    return out, logits_out


def _bound(base, skipper, **kw):
    model = copy.deepcopy(base)
    bind_skipper(model, skipper, **kw)
    return model


# -- (a) all-RUN through the routed path == dense ---------------------------------------------------------
def test_all_run_plain_matches_dense(base_model):
    all_run = StaticDepthSkipper(routed_layers=range(N_LAYERS), n_run=N_LAYERS)
    cohort = _bound(base_model, all_run, fast_path=False)  # forces the gather/mask/scatter path
    fast = _bound(base_model, StaticDepthSkipper(routed_layers=range(N_LAYERS), n_run=N_LAYERS))
    for i, p in enumerate(PROMPTS[:3]):
        want, want_logits = plain_greedy(base_model, p, request_id=f"req_{i}", max_new_tokens=NEW, return_logits=True)
        got, got_logits = plain_greedy(cohort, p, request_id=f"req_{i}", max_new_tokens=NEW, return_logits=True)
        assert got == want
        for a, b in zip(got_logits, want_logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        fast_ids, fast_logits = plain_greedy(fast, p, request_id=f"req_{i}", max_new_tokens=NEW, return_logits=True)
        assert fast_ids == want and all(torch.equal(a, b) for a, b in zip(fast_logits, want_logits))
    assert routed_context(cohort).skip_ratio() == 0.0


def test_all_run_engine_matches_dense(base_model):
    cohort = _bound(base_model, StaticDepthSkipper(routed_layers=range(N_LAYERS), n_run=N_LAYERS), fast_path=False)
    want, want_lp = generate_greedy(base_model, PROMPTS, max_new_tokens=NEW, mode="dense", cb_config=_cb(),
                                    return_logprobs=True)
    got, got_lp = generate_greedy(cohort, PROMPTS, max_new_tokens=NEW, mode="routed", cb_config=_cb(),
                                  return_logprobs=True)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=1e-5)
    plain = [plain_greedy(base_model, p, request_id="x", max_new_tokens=NEW) for p in PROMPTS]
    assert want == plain  # the dense engine itself agrees with plain PyTorch
    # dense mode of a bound model is the unmodified engine: the router is not consulted
    ctx = routed_context(cohort)
    ctx.reset_stats()
    assert generate_greedy(cohort, PROMPTS, max_new_tokens=NEW, mode="dense", cb_config=_cb()) == want
    assert ctx.counts == {}


# -- (b) Project-Only rows vs the per-row reference -------------------------------------------------------
def test_project_only_plain_matches_per_row_reference(base_model):
    skipper = ParitySkip(base_model.config.hidden_size)
    routed = _bound(base_model, skipper)
    n_changed = 0
    for i, p in enumerate(PROMPTS):
        rid = f"req_{i}"
        want, want_logits = _reference_greedy(base_model, skipper, p, rid, NEW)
        got, got_logits = plain_greedy(routed, p, request_id=rid, max_new_tokens=NEW, return_logits=True)
        assert got == want, rid
        for a, b in zip(got_logits, want_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        n_changed += got != plain_greedy(base_model, p, request_id=rid, max_new_tokens=NEW)
    assert n_changed >= 2  # skipping really changed the computation
    assert 0.2 < routed_context(routed).skip_ratio() < 0.45


def test_project_only_engine_matches_per_row_reference(base_model):
    skipper = ParitySkip(base_model.config.hidden_size)
    routed = _bound(base_model, skipper)
    got = generate_greedy(routed, PROMPTS, max_new_tokens=NEW, cb_config=_cb())
    want = [_reference_greedy(base_model, skipper, p, f"req_{i}", NEW)[0] for i, p in enumerate(PROMPTS)]
    assert got == want


def test_project_only_eager_attention_matches_reference():
    """The same check under eager attention (the engine switches it to paged|eager)."""
    base = _tiny("llama")
    base.set_attn_implementation("eager")
    skipper = ParitySkip(base.config.hidden_size)
    routed = _bound(base, skipper)
    want = [_reference_greedy(base, skipper, p, f"req_{i}", NEW)[0] for i, p in enumerate(PROMPTS)]
    assert [plain_greedy(routed, p, request_id=f"req_{i}", max_new_tokens=NEW) for i, p in enumerate(PROMPTS)] == want
    assert generate_greedy(routed, PROMPTS, max_new_tokens=NEW, cb_config=_cb()) == want
    assert routed.config._attn_implementation == "eager"  # restored after the engine ran paged|eager


def test_project_only_rows_write_their_own_kv(base_model):
    """Invariant 1: a layer where every row takes Project-Only still fills its cache with K/V computed by
    its own projections from the rows' input hidden states."""
    routed = _bound(base_model, StaticDepthSkipper(routed_layers=[2, 3], n_run=0))
    ids = torch.tensor([PROMPTS[1]])
    cache = DynamicCache(config=routed.config)
    plain_forward(routed, ids, cache, request_id="a", prompt_len=ids.shape[1])
    with torch.no_grad():
        hs = base_model(ids, output_hidden_states=True).hidden_states  # hs[2] enters layer 2 (same in both)
        layer = base_model.model.layers[2]
        attn = layer.self_attn
        import sys

        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        x = layer.input_layernorm(hs[2])
        k = attn.k_proj(x).view(1, ids.shape[1], -1, attn.head_dim)
        k = (attn.k_norm(k) if hasattr(attn, "k_norm") else k).transpose(1, 2)
        pe = base_model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
        k = rope(k, k, *pe)[1]
        v = attn.v_proj(x).view(1, ids.shape[1], -1, attn.head_dim).transpose(1, 2)
    torch.testing.assert_close(cache.layers[2].keys, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.layers[2].values, v, atol=1e-5, rtol=1e-5)
    # layer 3's input is layer 2's input (identity projector), so its K/V come from hs[2] too
    assert cache.layers[3].keys.shape == k.shape


# -- (c) the engine under RandomSkip == plain routed reference per request ---------------------------------
def test_random_skip_engine_matches_plain_per_request(base_model):
    skipper = RandomSkip(routed_layers=range(1, N_LAYERS), r=0.5, d=2 / 3, seed=3)
    routed = _bound(base_model, skipper)
    ctx = routed_context(routed)
    seen = []
    original_set = ctx.set_rows

    def spy(meta):
        if meta is not None:
            seen.append(meta)
        original_set(meta)

    ctx.set_rows = spy
    ids = [f"doc-{i}" for i in range(len(PROMPTS))]
    got = generate_greedy(routed, PROMPTS, max_new_tokens=NEW, request_ids=ids, cb_config=_cb())
    engine_ratio = {ph: ctx.skip_ratio(ph) for ph in (0, 1)}
    ctx.set_rows = original_set
    want = [plain_greedy(routed, p, request_id=rid, max_new_tokens=NEW) for rid, p in zip(ids, PROMPTS)]
    assert got == want
    dense = [plain_greedy(base_model, p, request_id="x", max_new_tokens=NEW) for p in PROMPTS]
    assert sum(g != d for g, d in zip(got, dense)) >= 2
    # the engine really packed several requests, chunked prefills and mixed phases in one batch
    assert any(len(set(m.request_ids)) >= 3 for m in seen)
    assert any(set(m.phase.tolist()) == {0, 1} for m in seen)
    assert any(_continues_a_prefill(m) for m in seen)  # a chunked prefill: later chunk of a prompt
    assert all(0.1 < r < 0.6 for r in engine_ratio.values())  # Project-Only rows in prefill and in decode


class _PerLayerRandomSkip(RandomSkip):
    """RandomSkip asked per layer (no route tape): the reference the tape must reproduce."""

    def route_tape(self, meta):
        return None


def test_route_tape_matches_per_layer_routes_in_the_engine(base_model):
    """The route tape (Sec. 3.1) changes where the masks are computed, not what they are: the same
    tokens, logprobs and RUN / Project-Only counts as the per-layer policy, in the engine's packed
    chunked-prefill batches (padding rows included)."""
    kw = dict(routed_layers=range(1, N_LAYERS), r=0.5, d=2 / 3, seed=3)
    tape_m, ref_m = _bound(base_model, RandomSkip(**kw)), _bound(base_model, _PerLayerRandomSkip(**kw))
    ids = [f"doc-{i}" for i in range(len(PROMPTS))]
    got, got_lp = generate_greedy(tape_m, PROMPTS, max_new_tokens=NEW, request_ids=ids, cb_config=_cb(),
                                  return_logprobs=True)
    want, want_lp = generate_greedy(ref_m, PROMPTS, max_new_tokens=NEW, request_ids=ids, cb_config=_cb(),
                                    return_logprobs=True)
    assert got == want and got_lp == want_lp
    assert routed_context(tape_m).counts == routed_context(ref_m).counts
    assert 0.1 < routed_context(tape_m).skip_ratio() < 0.6


def test_route_tape_is_built_once_per_forward_and_all_run_layers_go_dense(base_model, monkeypatch):
    from impl.vskipper.routed import RoutedDecoderLayer

    sk = StaticDepthSkipper(routed_layers=[1, 2, 3], n_run=2)  # layers 1, 2 all RUN; layer 3 Project-Only
    routed = _bound(base_model, sk)
    ctx = routed_context(routed)
    calls, cohort = [], []
    orig_tape, orig_cohort = sk.route_tape, RoutedDecoderLayer._cohort_forward
    monkeypatch.setattr(sk, "route_tape", lambda meta: calls.append(len(meta)) or orig_tape(meta))

    def spy(self, *a, **k):
        cohort.append(self.layer_idx)
        return orig_cohort(self, *a, **k)

    monkeypatch.setattr(RoutedDecoderLayer, "_cohort_forward", spy)
    ids = torch.tensor([[5, 6, 7, 8]])
    meta = RowMeta.for_sequence("a", 0, 4, prompt_len=4)
    with torch.no_grad(), ctx.rows(meta):
        a = routed(ids, position_ids=torch.arange(4)[None]).logits
        b = routed(ids, position_ids=torch.arange(4)[None]).logits  # a second forward on the same rows
    assert torch.equal(a, b)
    assert calls == [4, 4]  # one tape per forward, not per layer
    assert cohort == [3, 3]  # the all-RUN layers 1 and 2 never entered the cohort path
    assert ctx.counts == {(1, 0): [8, 0], (2, 0): [8, 0], (3, 0): [0, 8]}  # both forwards counted


def test_route_tape_counts_and_flags_match_the_per_layer_record():
    """The tape's host-side bookkeeping (one copy per step): all-RUN flags, any_routed and the per-phase
    RUN / Project-Only counts equal what RowContext.record counts layer by layer, on hand-built rows that
    mix prefill and decode rows, a dense row and engine padding."""
    from impl.vskipper.routed import RowContext

    sk = RandomSkip([2, 4, 5, 7], r=0.6, d=0.5, seed=3)
    rows = RowMeta.concat([RowMeta.for_sequence("p", 0, 5, prompt_len=5), RowMeta.for_sequence("d", 9, 3, prompt_len=8),
                           RowMeta.for_sequence("x", 4, 2, prompt_len=2)])
    routed = torch.ones(len(rows), dtype=torch.bool)
    routed[8] = False  # one dense row of request x
    meta = RowMeta(rows.request_ids, rows.token_idx, rows.phase, routed=routed).pad_to(13)
    ctx, ref = RowContext(), RowContext()
    tape = ctx.tape(sk, meta)
    raw = sk.route_tape(meta)
    want_run = raw | ~meta.routed_mask[:, None]
    assert torch.equal(tape.run, want_run)
    assert tape.all_run == tuple(bool(x) for x in want_run.all(dim=0)) and tape.any_routed
    for j, layer in enumerate(sk.routed_layers):
        ref.record(layer, want_run[:, j], meta)
    assert ctx.counts == ref.counts and {ph for _, ph in ctx.counts} == {0, 1}
    # every row dense: nothing routed, nothing counted, every layer all RUN
    dense = RowMeta(rows.request_ids, rows.token_idx, rows.phase, routed=torch.zeros(len(rows), dtype=torch.bool))
    empty = RowContext()
    t2 = empty.tape(sk, dense)
    assert all(t2.all_run) and not t2.any_routed and empty.counts == {}


def test_a_bad_route_tape_is_refused_at_the_layer(base_model):
    class Bad(StaticDepthSkipper):
        def route_tape(self, meta):
            return torch.ones(len(meta), 2, dtype=torch.bool)  # 3 routed layers

    routed = _bound(base_model, StaticDepthSkipper(routed_layers=[1, 2, 3], n_run=1))
    for layer in routed.model.layers[1:]:
        object.__setattr__(layer, "skipper", Bad(routed_layers=[1, 2, 3], n_run=1))
    with torch.no_grad(), routed_context(routed).rows(RowMeta.for_sequence("a", 0, 3, prompt_len=3)):
        with pytest.raises(ValueError, match=r"route_tape must return shape \[3, 3\]"):
            routed(torch.tensor([[5, 6, 7]]), position_ids=torch.arange(3)[None])


def _continues_a_prefill(meta):
    first = {}
    for rid, tok, ph in zip(meta.request_ids, meta.token_idx.tolist(), meta.phase.tolist()):
        first.setdefault(rid, (tok, ph))
    return any(tok > 0 and ph == 0 for tok, ph in first.values())


# -- errors ----------------------------------------------------------------------------------------------
def test_routed_layer_refuses_missing_or_stale_rows(base_model):
    routed = _bound(base_model, StaticDepthSkipper(routed_layers=[1], n_run=0))
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="no row metadata"):
        with torch.no_grad():
            routed(ids)
    ctx = routed_context(routed)
    with ctx.rows(RowMeta.for_sequence("a", 4, 3, prompt_len=3)):  # wrong positions
        with pytest.raises(RuntimeError, match="stale row metadata"):
            with torch.no_grad():
                routed(ids, position_ids=torch.arange(3)[None])
    with ctx.rows(RowMeta.for_sequence("a", 0, 5, prompt_len=3)):  # more rows than the batch
        with pytest.raises(RuntimeError, match="stale row metadata"):
            with torch.no_grad():
                routed(ids, position_ids=torch.arange(3)[None])


def test_binding_errors(base_model):
    with pytest.raises(ValueError, match="needs a model bound"):
        generate_greedy(base_model, PROMPTS[:1], max_new_tokens=2, mode="routed")
    with pytest.raises(ValueError, match="outside the model"):
        bind_skipper(copy.deepcopy(base_model), StaticDepthSkipper(routed_layers=[N_LAYERS], n_run=0))
    routed = _bound(base_model, RandomSkip(routed_layers=[1, 2], r=0.5, d=0.5))
    with pytest.raises(ValueError, match="already bound"):
        bind_skipper(routed, StaticDepthSkipper(routed_layers=[1], n_run=0))
    with pytest.raises(ValueError, match="allow_block_sharing=False"):
        generate_greedy(routed, PROMPTS[:1], max_new_tokens=2,
                        cb_config=routed_cb_config(allow_block_sharing=True, page_size=16, num_blocks=8))
    unbind_skipper(routed)
    assert routed_context(routed) is None
    assert not any(type(layer).__name__ == "RoutedDecoderLayer" for layer in routed.model.layers)
    assert plain_greedy(routed, PROMPTS[0], request_id="x", max_new_tokens=3) == plain_greedy(
        base_model, PROMPTS[0], request_id="x", max_new_tokens=3)
    flash = copy.deepcopy(base_model)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        bind_skipper(flash, StaticDepthSkipper(routed_layers=[1], n_run=0))
