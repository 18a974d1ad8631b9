"""Shared-context EAD: teacher-forced Omega agrees with the generation-time measurement on a model's
own generation, and both models are measured on identical sequences."""

import numpy as np

from impl.ead.accounting import stable_ead_from_omega
from impl.ead.measure import measure_prompt
from impl.ead.shared import shared_rows, teacher_forced_omega


def test_teacher_forced_equals_generation_on_own_output(tiny_model):
    prompt = [3, 1, 4, 1, 5, 9]
    rows = measure_prompt(tiny_model, prompt, 12)
    cont = [r["token_id"] for r in rows]
    om = teacher_forced_omega(tiny_model, prompt, cont).numpy()
    assert np.array_equal(om.astype(int), np.array([r["omega"] for r in rows]))
    assert stable_ead_from_omega(om).tolist() == [r["stable_ead"] for r in rows]


def test_shared_rows_cover_every_pair(tiny_model):
    prompts = [{"id": "p", "suite": "s", "input_ids": [2, 7, 1]}]
    gens = {("a", "p"): [5, 6, 7], ("b", "p"): [9, 9]}
    rows = shared_rows({"a": tiny_model, "b": tiny_model}, prompts, gens)
    assert len(rows) == 2 * (3 + 2)
    by = {}
    for r in rows:
        by.setdefault((r["source"], r["model"]), []).append(r["stable_ead"])
    # same weights -> identical measurements on identical sequences
    assert by[("a", "a")] == by[("a", "b")] and by[("b", "a")] == by[("b", "b")]
