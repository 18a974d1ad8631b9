"""The shared result records (impl/spec/result.py): every method's record extends one base, and the
draft-and-verify accounting is computed once."""

import dataclasses

import pytest

from impl.dex.decoder import DEXResult
from impl.spec.adadecode import AdaDecodeResult, AdaRound
from impl.spec.ar import ARResult
from impl.spec.dynamic_exit import DELResult
from impl.spec.hf_early_exit import HFEarlyExitResult
from impl.spec.result import DecodeResult, DraftVerifyResult
from impl.spec.self_spec import SelfSpecResult, SpecRound
from impl.tev.decode import TEVResult


@pytest.mark.parametrize("cls", [ARResult, HFEarlyExitResult, DEXResult, TEVResult, SelfSpecResult, DELResult,
                                 AdaDecodeResult])
def test_every_method_record_extends_the_base(cls):
    assert issubclass(cls, DecodeResult)
    names = [f.name for f in dataclasses.fields(cls)]
    assert names[:3] == ["tokens", "stopped_at_eos", "prefill_seconds"]
    assert all(f.kw_only for f in dataclasses.fields(cls))


def test_draft_verify_accounting():
    rounds = [SpecRound(drafted=3, accepted=2, exit_layer=2, committed=3, planned=3, layer_work=16, critical_layers=10),
              SpecRound(drafted=2, accepted=0, exit_layer=2, committed=1, planned=2, layer_work=12, critical_layers=8)]
    r = SelfSpecResult(tokens=[1, 2, 3, 4], rounds=rounds, layer_work=28, critical_layers=18)
    assert isinstance(r, DraftVerifyResult) and r.num_tokens == 4
    assert r.layer_work_per_token == 7.0 and r.critical_layers_per_token == 4.5
    assert r.tokens_per_round == 2.0 and r.acceptance_rate == pytest.approx(2 / 5)
    assert SelfSpecResult(tokens=[]).acceptance_rate == 0.0 and SelfSpecResult(tokens=[]).layer_work_per_token == 0.0
    ada = AdaDecodeResult(tokens=[5], rounds=[AdaRound(drafted=1, accepted=1, exit_layers=[2], committed=1, steps=2,
                                                       layer_work=4, critical_layers=3)])
    assert ada.early_tokens == 1 and ada.tokens_per_round == 1.0
    with pytest.raises(TypeError):
        ARResult([1, 2])  # keyword-only: a positional record cannot silently shift its fields
