"""The result records of the decoding methods: one base that every method's record extends.

:class:`DecodeResult` holds what every method returns (the generated ids, whether EOS stopped the run,
the prefill time); :class:`DraftVerifyResult` adds the per-round record and the layer accounting of the
draft-and-verify baselines (LayerSkip self-speculation, DEL, AdaDecode; DEX Sec. 4 / App. D, Prop. 7:
token-layer work and critical-path layers after the prompt prefill). AR (:mod:`.ar`), transformers'
early-exit reference (:mod:`.hf_early_exit`), its prompt-lookup arm (:mod:`.hf_prompt_lookup`), DEX (:mod:`impl.dex.decoder`) and TEV
(:mod:`impl.tev.decode`) extend :class:`DecodeResult` with their own per-token or per-round fields.

Every record is a keyword-only dataclass (construct it with field names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DecodeResult", "DraftVerifyResult"]


@dataclass(kw_only=True)
class DecodeResult:
    """What every decoding method returns.

    Attributes:
        tokens: generated token ids, prompt excluded (EOS included when it stopped the run).
        stopped_at_eos: whether EOS ended the run before ``max_new_tokens``.
        prefill_seconds: wall time of the prompt prefill (seconds; 0 where the method has no separate
            prefill).
    """

    tokens: list[int] = field(default_factory=list)
    stopped_at_eos: bool = False
    prefill_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Generated tokens (EOS included)."""
        return len(self.tokens)


@dataclass(kw_only=True)
class DraftVerifyResult(DecodeResult):
    """A draft-and-verify run with layer accounting (LSSD, DEL, AdaDecode).

    Attributes:
        rounds: one record per verification round (each with ``drafted``, ``accepted`` and
            ``committed``: tokens appended).
        layer_work: total token-layer evaluations after the prompt prefill (DEX Prop. 7).
        critical_layers: total sequential decoder layers after the prompt prefill.
        readout_rows: rows passed through the final norm + LM head.
        seconds: wall time of the whole decode, prefill included (seconds).
    """

    rounds: list = field(default_factory=list)
    layer_work: int = 0
    critical_layers: int = 0
    readout_rows: int = 0
    seconds: float = 0.0

    @property
    def layer_work_per_token(self) -> float:
        """Token-layer evaluations per generated token (AR: L)."""
        return self.layer_work / max(len(self.tokens), 1)

    @property
    def critical_layers_per_token(self) -> float:
        """Sequential layers per generated token (AR: L)."""
        return self.critical_layers / max(len(self.tokens), 1)

    @property
    def tokens_per_round(self) -> float:
        """tau: committed tokens per verification round, bonus included (micro average)."""
        return sum(r.committed for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens, pooled over rounds (0 when nothing was drafted)."""
        d = sum(r.drafted for r in self.rounds)
        return sum(r.accepted for r in self.rounds) / d if d else 0.0
