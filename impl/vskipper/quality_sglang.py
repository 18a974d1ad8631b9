"""Arms C and D of the quality 2x2 served by upstream SGLang (vSkipper Sec. 4.1 "Quality", Table 5 left,
App. E.1; the paper's engine): C is SGLang serving the base model, D is SGLang serving vSkipper's routed
Llama (:mod:`impl.vskipper.sglang_model`) always-route with the checkpoint's skipper.

lm-eval stays the client (:class:`SGLangCompletionsLM`: the project's recording ``local-completions``
client, :class:`~impl.vskipper.quality_arms.RecordingCompletionsLM`), speaking SGLang's dialect of the
same records:

- *request ids*: each request carries ``rid = "<task>/<doc_id>"`` (SGLang's request id, what
  request-hashing skippers hash: the same id arm B uses) with its prompt as one flat token-id list (SGLang
  treats a list of lists as a batch and suffixes its items' rids), and SGLang's response ``id`` is that rid;
- *generated ids*: ``return_token_ids`` makes SGLang return every choice's ``token_ids``;
- *received ids*: with it SGLang also returns the ``prompt_token_ids`` its scheduler tokenized for the
  request: the server-side record the prompt-hash gate compares (the in-process server records them
  from its engine's ``submit``);
- *first-token log-probabilities* come from SGLang's native ``/generate`` (``return_logprob``,
  ``top_logprobs_num``), whose top entries carry token ids (its OpenAI completions keys them by text).

The routed server's per-request modes are not in SGLang's responses; the arm's route counts (RUN /
Project-Only rows per phase) are in its stats (:meth:`RoutedSGLangArm.describe`), recorded with the arm.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, Sequence

import torch
from lm_eval.models.openai_completions import LocalCompletionsAPI

from impl.serving.sglang_arm import SGLangArm
from impl.serving.sglang_server import SGLangLaunch

from .quality_arms import RecordingCompletionsLM, StopRule, post_json
from .sglang_routed import RoutedSGLangArm

__all__ = ["SGLangCompletionsLM", "sglang_quality_arm"]


class SGLangCompletionsLM(RecordingCompletionsLM):
    """lm-eval's ``local-completions`` client against an SGLang server, recording as
    :class:`~impl.vskipper.quality_arms.RecordingCompletionsLM` does (module docstring for the dialect).

    Args:
        arm: arm label (``"C"`` or ``"D"``).
        generate_url: the server's native ``/generate`` endpoint (first-token log-probabilities).
        **kwargs: :class:`RecordingCompletionsLM`'s arguments but ``received`` (filled here from the
            responses' ``prompt_token_ids``).
    """

    def __init__(self, arm: str, *, generate_url: str, **kwargs):
        super().__init__(arm, received={}, **kwargs)
        self.generate_url = str(generate_url)
        self._until: dict[str, list[str]] = {}
        self._budget: dict[str, int] = {}

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if generate:
            rid = payload.pop("request_id")
            payload["rid"] = rid
            payload["return_token_ids"] = True
            # the stop strings are applied here, by HFLM's rule on the ids (as the in-process engine arms do):
            # SGLang drops the tokens of a matched stop string from its token_ids, so its own stop would
            # cut the recorded ids short of arm A's (greedy decoding is causal: the kept prefix is the same)
            self._until[rid] = list(payload.pop("stop", None) or [])
            self._budget[rid] = int(payload.get("max_tokens") or self._max_gen_toks)
            # one token-id prompt, not a batch of one: SGLang suffixes a batch item's rid ("<rid>_0"), which
            # would change both the response id and what a request-hashing skipper hashes
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                payload["prompt"] = prompt[0]
        return payload

    def parse_generations(self, outputs, **kwargs) -> list[str]:
        """lm-eval's parsing, after recording every response by its rid (SGLang's response ``id``): the
        generated ``token_ids`` (with the EOS id SGLang stopped at, which it reports as ``matched_stop``)
        and the ``prompt_token_ids`` SGLang received; the text lm-eval gets is the ids cut by HFLM's stop
        rule (:class:`~impl.vskipper.quality_arms.StopRule`) and decoded as arm A's."""
        for out in outputs if isinstance(outputs, list) else [outputs]:
            if not isinstance(out, Mapping) or out.get("id") is None:
                continue
            rid = str(out["id"])
            for ch in (out.get("choices") or [])[:1]:
                ids = [int(t) for t in ch.get("token_ids") or []]
                stop = ch.get("matched_stop")
                if isinstance(stop, int) and not isinstance(stop, bool) and (not ids or ids[-1] != stop):
                    ids.append(stop)
                rule = StopRule(self.tokenizer, self._until.get(rid, []), self.eos_ids)
                ch["text"] = rule.text(rule.cut(ids[:self._budget.get(rid, len(ids))]))
                self._responses[rid] = {"text": ch["text"], "token_ids": ids, "finish_reason": ch.get("finish_reason"),
                                        "vskipper": {"request_id": rid, "engine": "sglang"}}
                if ch.get("prompt_token_ids") is not None:
                    self.received[rid] = [int(t) for t in ch["prompt_token_ids"]]
        return LocalCompletionsAPI.parse_generations(outputs, **kwargs)

    def first_token_logprobs(self, prompt_ids: Sequence[int], request_id: str) -> torch.Tensor:
        """``[V]`` float32 first-token log-probabilities as served (greedy, one token, SGLang's
        ``/generate`` with ``top_logprobs_num = max_logprobs`` and ``rid`` = the document's, so that a
        request-hashing skipper takes the generation's routes); entries outside the top-k are ``-inf``.

        Raises:
            RuntimeError: for an HTTP error or a response without log-probabilities.
        """
        out = post_json(self.generate_url, {
            "input_ids": [int(t) for t in prompt_ids], "rid": str(request_id),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": self.max_logprobs}, timeout_s=self.timeout_s)
        try:
            meta = out["meta_info"]
            top = meta["output_top_logprobs"][0]  # [(logprob, token_id, text)]
            chosen_lp, chosen = meta["output_token_logprobs"][0][:2]
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"arm {self.arm}: SGLang returned no first-token log-probabilities: {out}") from exc
        size = int(self.vocab_size or max(len(self.tokenizer), 1 + max(int(t[1]) for t in top)))
        vec = torch.full((size,), float("-inf"), dtype=torch.float32)
        for lp, tok, *_ in top:
            vec[int(tok)] = float(lp)
        if vec[int(chosen)] == float("-inf"):
            vec[int(chosen)] = float(chosen_lp)
        return vec


@contextlib.contextmanager
def sglang_quality_arm(arm: str, launch: SGLangLaunch, *, policy: str | None = None,
                       policy_kwargs: Mapping[str, Any] | None = None, ready_timeout_s: float = 900.0,
                       request_timeout_s: float = 3600.0):
    """The SGLang server of quality arm C (``policy`` None: upstream SGLang on ``launch.model_dir``) or D
    (vSkipper's routed Llama always-route with ``policy`` / ``policy_kwargs``, answering to the base
    model's name), started (warm-up excluded) and shut down on exit.

    Yields:
        the started :class:`~impl.serving.sglang_arm.SGLangArm` (its ``server.url``,
        ``served_model_name`` and ``describe()``).

    Raises:
        ValueError: D without a policy; FileNotFoundError / RuntimeError: from the server's start.
    """
    if arm == "D" and not policy:
        raise ValueError("quality arm D on SGLang needs the skipper's policy (e.g. 'flexidepth' and its checkpoint)")
    if arm == "D":
        server = RoutedSGLangArm(launch, policy, policy_kwargs, switch=None, name="always-route",
                                 ready_timeout_s=ready_timeout_s, request_timeout_s=request_timeout_s)
    else:
        server = SGLangArm(launch, name="upstream", ready_timeout_s=ready_timeout_s,
                           request_timeout_s=request_timeout_s)
    try:
        server.start()
        server.stop()  # the warm-up ran; lm-eval sends the requests itself
        yield server
    finally:
        server.close()
